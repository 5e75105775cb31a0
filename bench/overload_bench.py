#!/usr/bin/python3
"""Goodput and TTFT of a live Strata cluster against offered load, from below its capacity to
5x above (issue 40): a cluster that admits only what it can serve keeps its goodput flat past
saturation and refuses the rest at once (429 + Retry-After), instead of timing everyone out.

  1. Capacity: a closed loop of --clients concurrent streams for --seconds; the completed
     requests per second are the cluster's capacity C (the denominator of every load below).
  2. Open loop: Poisson arrivals at 0.5, 1, 1.5, 2, 3 and 5 x C for --seconds each (every
     request on a thread of its own, so the clients never queue), then the cluster drains.
     Per step: completed, refused (429 before any byte) and failed requests; goodput (tokens of
     completed requests per second of the step); TTFT p50 / p99 of the completed ones.

Per step, the CPU seconds each process spent (router, prefill and decode nodes, store, and this
client, all on the same cores) show what the cores went to as the load grew.

Every request is a greedy stream of exactly --max_tokens tokens (ignore_eos) over a prompt of
about 100 tokens under a cache salt of its own (no prefix reuse: every prefill computes).
Results: bench/results/overload_bench-DATE-COMMIT.{txt,json} with the machine, date and commit.

  bench/overload_bench.py [--build build] [--codec kivi:k4v4:g32] [--seconds 20] [--out DIR]
Standard library only (Debian's /usr/bin/python3). Needs the built binaries.
"""
import argparse
import concurrent.futures
import json
import os
import random
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import cluster_e2e_test as e2e  # noqa: E402
from cluster_bench import run_info  # noqa: E402

LOADS = [0.5, 1.0, 1.5, 2.0, 3.0, 5.0]


def one(base, prompt, salt, max_tokens):
    """(outcome, ttft, tokens, seconds): outcome "ok", "429" or "error: ..."."""
    body = {"model": "strata-tiny", "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "cache_salt": salt, "ignore_eos": True}
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    ttft, tokens = None, 0
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return "ok", ttft, tokens, time.monotonic() - t0
                event = json.loads(line[6:])
                if "error" in event:
                    return "error: %s" % event["error"].get("message", "")[:120], ttft, tokens, 0
                if event.get("choices") and event["choices"][0].get("finish_reason") is None:
                    tokens += 1
                    if ttft is None:
                        ttft = time.monotonic() - t0
        return "error: no [DONE]", ttft, tokens, 0
    except urllib.error.HTTPError as e:
        return ("429" if e.code == 429 else "error: HTTP %d" % e.code), None, 0, 0
    except OSError as e:
        return "error: %s" % e, None, 0, 0


def cpu_seconds(c):
    """CPU seconds (user + system) so far of each cluster process, and of this client."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, pid in c.pids().items():
        try:
            with open("/proc/%d/stat" % pid) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[name.split("-")[0]] = out.get(name.split("-")[0], 0.0) + \
                (int(fields[11]) + int(fields[12])) / tick
        except OSError:
            pass
    t = os.times()
    out["client"] = t.user + t.system
    return out


def quantile(values, q):
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def summarize(name, offered, results, seconds):
    ok = [r for r in results if r[0] == "ok"]
    refused = sum(1 for r in results if r[0] == "429")
    errors = [r[0] for r in results if r[0].startswith("error")]
    ttfts = [r[1] for r in ok if r[1] is not None]
    return {
        "step": name, "offered_rps": offered, "requests": len(results), "completed": len(ok),
        "refused_429": refused, "failed": len(errors),
        "failures": sorted(set(errors))[:5],
        "goodput_tokens_per_s": sum(r[2] for r in ok) / seconds,
        "completed_rps": len(ok) / seconds,
        "ttft_p50_s": quantile(ttfts, 0.5), "ttft_p99_s": quantile(ttfts, 0.99),
    }


def wait_idle(c, timeout=300):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if e2e.metric(e2e.scrape(c.base.replace("http://", "")), "strata_router_in_flight") == 0:
            return
        time.sleep(0.5)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--codec", default="kivi:k4v4:g32")
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--max_tokens", type=int, default=32)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    a = ap.parse_args()
    e2e.BUILD = os.path.abspath(a.build)
    commit, now, machine = run_info()
    words = e2e.LONG.split()
    counter = iter(range(10**9))
    lock = threading.Lock()

    def request(c):
        with lock:
            i = next(counter)
        prompt = " ".join(words[(i * 7) % len(words):] + words[:(i * 7) % len(words)])
        return one(c.base, e2e.PROMPTS[i % len(e2e.PROMPTS)] + " " + prompt, "ovl-%d" % i,
                   a.max_tokens)

    c = e2e.Cluster(a.codec, prefill=2, decode=2)
    steps = []
    try:
        # 1. Capacity: a closed loop.
        stop = time.monotonic() + a.seconds
        closed = []

        def client():
            while time.monotonic() < stop:
                r = request(c)
                with lock:
                    closed.append(r)
                if r[0] == "429":
                    time.sleep(0.05)
        t0 = time.monotonic()
        threads = [threading.Thread(target=client) for _ in range(a.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        capacity = summarize("closed loop x%d" % a.clients, float("nan"), closed,
                             time.monotonic() - t0)
        steps.append(capacity)
        rps = max(capacity["completed_rps"], 0.1)
        print("capacity: %.2f requests/s (%.0f tokens/s)" %
              (rps, capacity["goodput_tokens_per_s"]), flush=True)
        wait_idle(c)
        # 2. Open loop at multiples of it.
        rng = random.Random(40)
        for load in LOADS:
            rate = load * rps
            results, futures = [], []
            cpu0 = cpu_seconds(c)
            with concurrent.futures.ThreadPoolExecutor(4096) as pool:
                t0 = time.monotonic()
                t = t0
                while True:
                    t += rng.expovariate(rate)
                    if t - t0 > a.seconds:
                        break
                    time.sleep(max(0.0, t - time.monotonic()))
                    futures.append(pool.submit(request, c))
                for f in futures:
                    results.append(f.result())
            elapsed = time.monotonic() - t0
            s = summarize("%.1fx" % load, rate, results, elapsed)
            cpu1 = cpu_seconds(c)
            s["cpu_seconds"] = {k: round(cpu1[k] - cpu0.get(k, 0), 2) for k in cpu1}
            steps.append(s)
            print(json.dumps(s), flush=True)
            wait_idle(c)
    finally:
        c.down()

    base = next(s for s in steps if s["step"] == "1.0x")
    lines = ["Strata overload benchmark (bench/overload_bench.py): goodput against offered load",
             "machine: %s" % machine, "date: %s" % now.strftime("%Y-%m-%d %H:%M UTC"),
             "commit: %s" % commit,
             "cluster: deploy/local/cluster.sh, 2 prefill + 2 decode nodes, %s, chunk %d, "
             "max_batch 32; each request ~100 prompt tokens (own cache salt), %d tokens out" %
             (a.codec, e2e.CHUNK, a.max_tokens),
             "capacity C (closed loop of %d streams): %.2f requests/s" % (a.clients, rps), "",
             "| offered | req/s | requests | completed | 429 | failed | goodput tok/s | of 1x "
             "| TTFT p50 s | TTFT p99 s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for s in steps:
        lines.append("| %s | %.2f | %d | %d | %d | %d | %.0f | %.2f | %.2f | %.2f |" % (
            s["step"], s["offered_rps"], s["requests"], s["completed"], s["refused_429"],
            s["failed"], s["goodput_tokens_per_s"],
            s["goodput_tokens_per_s"] / max(base["goodput_tokens_per_s"], 1e-9),
            s["ttft_p50_s"], s["ttft_p99_s"]))
    lines += ["", "CPU seconds per step (the same 2 cores serve every process and the client):", "",
              "| offered | " + " | ".join(sorted(steps[-1]["cpu_seconds"])) + " |",
              "| --- |" + " ---: |" * len(steps[-1]["cpu_seconds"])]
    for s in steps[1:]:
        cpu = s["cpu_seconds"]
        lines.append("| %s | " % s["step"] + " | ".join("%.1f" % cpu.get(k, 0)
                                                       for k in sorted(cpu)) + " |")
    failures = sorted({f for s in steps for f in s["failures"]})
    if failures:
        lines += ["", "failures: " + "; ".join(failures)]
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(a.out, exist_ok=True)
    stem = os.path.join(a.out, "overload_bench-%s-%s" % (now.strftime("%Y-%m-%d"), commit))
    with open(stem + ".txt", "w") as f:
        f.write(text)
    with open(stem + ".json", "w") as f:
        json.dump({"machine": machine, "date": now.isoformat(), "commit": commit,
                   "codec": a.codec, "capacity_rps": rps, "steps": steps}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
