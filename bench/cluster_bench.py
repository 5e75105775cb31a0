#!/usr/bin/python3
"""Benchmarks of a live Strata cluster (deploy/local/cluster.sh), written as text and JSON to
bench/results/cluster_bench-DATE-COMMIT.{txt,json} with the machine, date and commit:

  1. TTFT with a cached prefix against recomputing it, at 512, 1024 and 1920 cached tokens (the
     bundled model's context is 2048): each size is sent cold (a fresh cache salt: nothing to
     reuse) and warm (the same prefix again, a new suffix), medians of --repeats.
  2. Decode throughput through the cluster at 1 and 32 concurrent streams against single-process
     `strata generate` with the same codec, measured in the same run.
  3. The router's added latency per token: its strata_router_token_relay_seconds histogram (from
     a token's arrival from the decode node to the end of the socket write that carries it to the
     client), p50 and p99 interpolated within buckets, at 1 and 32 streams; and the client-side
     gap between tokens next to the decode node's own inter-token histogram.
  4. Bytes on the wire per request against the prompt's KV at fp16, per codec, at a 1,920-token
     prompt (blocks, the full-precision window of the partial last chunk, and every header).

  bench/cluster_bench.py [--build build] [--codec kivi:k4v4:g32] [--repeats 5] [--out DIR]
Standard library only (Debian's /usr/bin/python3). Needs the built binaries.
"""
import argparse
import concurrent.futures
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))
import cluster_e2e_test as e2e  # noqa: E402  (the e2e tests' Cluster and HTTP helpers)

WORDS = ("tide storm harbour lamp granite quarry chapel shelf letter map keeper boat gale cliff "
         "rope anchor gull net lantern beacon").split()


def text_of_tokens(n, seed):
    """Text of about n tokens of the bundled tokenizer (measured, then trimmed by the caller)."""
    words = [WORDS[(i * 7 + seed) % len(WORDS)] for i in range(n)]
    return " ".join(words)


def tokenize(build, text):
    out = subprocess.run([os.path.join(build, "tools/strata"), "generate", "--model", e2e.MODEL,
                          "--codec", "fp16", "--max_tokens", "1", "--prompt", text],
                         capture_output=True, text=True, check=True).stderr
    return int(out.split("[", 1)[1].split(" prompt tokens")[0])


def prompt_of(build, tokens, seed):
    """A prompt of exactly about `tokens` tokens (BOS included), by bisection on words."""
    lo, hi = 1, tokens * 2
    best = text_of_tokens(1, seed)
    while lo <= hi:
        mid = (lo + hi) // 2
        t = text_of_tokens(mid, seed)
        if tokenize(build, t) <= tokens:
            best, lo = t, mid + 1
        else:
            hi = mid - 1
    return best


def stream(base, prompt, max_tokens, salt, temperature=0.0, seed=None):
    """One streamed completion of exactly max_tokens tokens (ignore_eos): (ttft, gaps between
    tokens, usage, seconds from the first token to the last)."""
    body = {"model": "strata-tiny", "prompt": prompt, "max_tokens": max_tokens,
            "temperature": temperature, "stream": True, "cache_salt": salt, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    if seed is not None:
        body["seed"] = seed
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    times, usage = [], None
    with urllib.request.urlopen(req, timeout=60) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"])
            if event.get("choices") and event["choices"][0].get("finish_reason") is None:
                times.append(time.monotonic())
            if event.get("usage"):
                usage = event["usage"]
    ttft = times[0] - t0 if times else float("nan")
    gaps = [b - a for a, b in zip(times, times[1:])]
    return ttft, gaps, usage, (times[-1] - times[0]) if len(times) > 1 else 0.0


def solo_tok_per_s(build, codec, prompt, n):
    out = subprocess.run([os.path.join(build, "tools/strata"), "generate", "--model", e2e.MODEL,
                          "--codec", codec, "--kv_chunk_tokens", str(e2e.CHUNK), "--max_tokens",
                          str(n), "--temperature", "1.0", "--seed", "3", "--prompt", prompt],
                         capture_output=True, text=True, check=True).stderr
    # "[... N generated in S s (T tok/s); ..."
    part = out.split(" generated in ", 1)[1]
    return float(part.split("(", 1)[1].split(" tok/s", 1)[0])


def histogram_quantile(values, name, q):
    """The q-quantile of a Prometheus histogram (cumulative buckets), interpolated linearly
    within its bucket as PromQL's histogram_quantile does."""
    buckets = []
    for k, v in values.items():
        if k.startswith(name + "_bucket{"):
            le = k.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), v))
    buckets.sort()
    total = buckets[-1][1] if buckets else 0
    if total <= 0:
        return float("nan")
    rank, lo, below = q * total, 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == float("inf"):
                return lo
            return lo + (le - lo) * (rank - below) / max(count - below, 1e-12)
        lo, below = le, count
    return float("nan")


def delta(after, before):
    return {k: after.get(k, 0) - before.get(k, 0) for k in after}


def run_info():
    """(commit, "-dirty" when the tree differs; UTC now; "host / CPU / N cores") for a results
    file's name and header."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip() or "unknown"
    if subprocess.run(["git", "diff", "--quiet"], cwd=ROOT).returncode != 0:
        commit += "-dirty"
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    now = datetime.datetime.now(datetime.timezone.utc)
    return commit, now, "%s / %s / %d cores" % (platform.node(), cpu, os.cpu_count())


def write_results(out_dir, name, now, commit, text, report):
    """out_dir/name-DATE-COMMIT.{txt,json}: the table and the report; returns the stem."""
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, "%s-%s-%s" % (name, now.strftime("%Y-%m-%d"), commit))
    with open(stem + ".txt", "w") as f:
        f.write(text)
    with open(stem + ".json", "w") as f:
        json.dump(report, f, indent=1)
    return stem


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--codec", default="kivi:k4v4:g32")
    ap.add_argument("--wire_codecs", default="fp16,kivi:k4v4:g32,kivi:k2v2:g32,gear:k2v2:g32:r4:s2")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = ap.parse_args()
    e2e.BUILD = os.path.abspath(args.build)
    commit, now, machine = run_info()
    report = {"commit": commit, "date": now.strftime("%Y-%m-%dT%H:%M:%SZ"), "machine": machine,
              "codec": args.codec, "chunk_tokens": e2e.CHUNK, "model": "strata-tiny"}
    lines = ["cluster_bench  commit %s  %s  %s" % (commit, report["date"], report["machine"]),
             "cluster: store + 1 prefill + 1 decode + router on loopback (UCX), codec %s, "
             "chunks of %d tokens, bundled model" % (args.codec, e2e.CHUNK), ""]

    c = e2e.Cluster(args.codec, prefill=1, decode=1)
    try:
        # 1. TTFT cached vs recompute.
        lines.append("1. TTFT, cached prefix vs recomputing it (median of %d, ms)" % args.repeats)
        lines.append("%8s %8s %10s %10s %8s" % ("cached", "prompt", "recompute", "cached",
                                                "speedup"))
        report["ttft"] = []
        for size in (512, 1024, 1920):
            prefix = prompt_of(args.build, size + 8, size)
            cold, warm, cached_tokens, prompt_tokens = [], [], 0, 0
            for r in range(args.repeats):
                salt = "ttft-%d-%d-%f" % (size, r, time.time())
                t_cold, _, u_cold, _ = e2e_stream(c, prefix + " alpha", salt)
                time.sleep(0.3)  # the Puts land
                t_warm, _, u_warm, _ = e2e_stream(c, prefix + " beta gull", salt)
                cold.append(t_cold)
                warm.append(t_warm)
                cached_tokens = u_warm["prompt_tokens_details"]["cached_tokens"]
                prompt_tokens = u_warm["prompt_tokens"]
                assert u_cold["prompt_tokens_details"]["cached_tokens"] == 0
            mc, mw = statistics.median(cold) * 1e3, statistics.median(warm) * 1e3
            lines.append("%8d %8d %10.1f %10.1f %7.2fx" % (cached_tokens, prompt_tokens, mc, mw,
                                                          mc / mw))
            report["ttft"].append({"cached_tokens": cached_tokens, "prompt_tokens": prompt_tokens,
                                   "recompute_ms": mc, "cached_ms": mw, "speedup": mc / mw})
        lines.append("")

        # 2. Throughput, 1 and 32 streams, against strata generate.
        n = 128
        prompt = prompt_of(args.build, 200, 99)
        solo = statistics.median(solo_tok_per_s(args.build, args.codec, prompt, n)
                                 for _ in range(3))
        one = []
        for r in range(3):
            _, _, u, decode_s = e2e_stream(c, prompt, "tput1-%d" % r, n, 1.0)
            one.append((u["completion_tokens"] - 1) / decode_s)
        cluster1 = statistics.median(one)
        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            results = list(pool.map(lambda i: e2e_stream(c, prompt + " %d" % i, "tput32-%d" % i,
                                                         n, 1.0), range(32)))
        wall = time.monotonic() - t0
        tokens32 = sum(u["completion_tokens"] for _, _, u, _ in results)
        per_stream32 = statistics.median((u["completion_tokens"] - 1) / d
                                         for _, _, u, d in results if d > 0)
        lines.append("2. Decode throughput, %d tokens per stream (tok/s)" % n)
        lines.append("   strata generate, 1 stream (single process):   %8.1f" % solo)
        lines.append("   cluster, 1 stream:                            %8.1f  (%.2fx)" % (
            cluster1, cluster1 / solo))
        lines.append("   cluster, 32 streams, aggregate (wall clock):   %8.1f  (%.2fx of 1 solo "
                     "stream)" % (tokens32 / wall, tokens32 / wall / solo))
        lines.append("   cluster, 32 streams, per stream (median):     %8.1f" % per_stream32)
        lines.append("")
        report["throughput"] = {"solo_tok_s": solo, "cluster_1_tok_s": cluster1,
                                "cluster_32_aggregate_tok_s": tokens32 / wall,
                                "cluster_32_per_stream_tok_s": per_stream32}

        # 3. The router's added latency per token, and client vs decode-node gaps.
        decode_metrics = c.node("decode-0")["metrics"]
        router_metrics = c.base.replace("http://", "")
        relay = "strata_router_token_relay_seconds"
        before_d, before_r = e2e.scrape(decode_metrics), e2e.scrape(router_metrics)
        gaps = []
        for r in range(3):
            _, g, _, _ = e2e_stream(c, prompt, "lat-%d" % r, n, 1.0)
            gaps += g
        d_dec = delta(e2e.scrape(decode_metrics), before_d)
        d_rt1 = delta(e2e.scrape(router_metrics), before_r)
        node_p50 = histogram_quantile(d_dec, "strata_decode_inter_token_seconds", 0.5)
        client_p50 = statistics.median(gaps)
        before_r = e2e.scrape(router_metrics)
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            list(pool.map(lambda i: e2e_stream(c, prompt + " %d" % i, "lat32-%d" % i, n, 1.0),
                          range(32)))
        d_rt32 = delta(e2e.scrape(router_metrics), before_r)
        lines.append("3. Router's added latency per token (ms): arrival from the decode node to the "
                     "end of the socket write")
        report["latency"] = {}
        for label, d in (("1 stream", d_rt1), ("32 streams", d_rt32)):
            p50 = histogram_quantile(d, relay, 0.5) * 1e3
            p99 = histogram_quantile(d, relay, 0.99) * 1e3
            count = e2e.metric(d, relay + "_count")
            lines.append("   %-10s  p50 %7.3f   p99 %7.3f   (%d tokens)" % (label, p50, p99, count))
            report["latency"][label] = {"relay_p50_ms": p50, "relay_p99_ms": p99,
                                        "tokens": count}
        lines.append("   1 stream: client-side gap between tokens p50 %.3f ms; the decode node's "
                     "inter-token p50 %.3f ms" % (client_p50 * 1e3, node_p50 * 1e3))
        lines.append("")
        report["latency"]["client_gap_p50_ms"] = client_p50 * 1e3
        report["latency"]["decode_inter_token_p50_ms"] = node_p50 * 1e3
    finally:
        c.down()

    # 4. Bytes on the wire per codec.
    lines.append("4. Bytes shipped prefill -> decode per request, 1,920-token prompt")
    lines.append("%-24s %12s %12s %8s %12s" % ("codec", "shipped", "fp16 KV", "ratio",
                                              "blocks only"))
    report["wire"] = []
    prompt = prompt_of(args.build, 1920, 7)
    for codec in args.wire_codecs.split(","):
        c = e2e.Cluster(codec, prefill=1, decode=1)
        try:
            m = c.node("prefill-0")["metrics"]
            before = e2e.scrape(m)
            _, _, u, _ = e2e_stream(c, prompt, "wire", 2)
            # The prefill node counts its request when its Prefill call returns, which may be
            # just after the client's stream ended.
            shipped = 0
            for _ in range(50):
                shipped = e2e.metric(e2e.scrape(m), "strata_prefill_bytes_shipped_total") - \
                    e2e.metric(before, "strata_prefill_bytes_shipped_total")
                if shipped > 0:
                    break
                time.sleep(0.1)
            if shipped <= 0:
                raise RuntimeError("%s: the prefill node counted no bytes shipped" % codec)
            cfg = json.load(open(os.path.join(e2e.MODEL, "config.json")))
            fp16 = u["prompt_tokens"] * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * \
                cfg["head_dim"] * 2 * 2
            # The codec's own ratio: the full chunks' blocks (the codec's metadata included)
            # against the same chunks at fp16, from the prefill node's counters.
            after = e2e.scrape(m)
            blocks = e2e.metric(after, "strata_prefill_block_bytes_total") - \
                e2e.metric(before, "strata_prefill_block_bytes_total")
            blocks_fp16 = e2e.metric(after, "strata_prefill_fp16_bytes_total") - \
                e2e.metric(before, "strata_prefill_fp16_bytes_total")
            lines.append("%-24s %12d %12d %7.2fx %11.2fx" % (codec, shipped, fp16, fp16 / shipped,
                                                             blocks_fp16 / max(blocks, 1)))
            report["wire"].append({"codec": codec, "prompt_tokens": u["prompt_tokens"],
                                   "bytes_shipped": shipped, "fp16_bytes": fp16,
                                   "block_bytes": blocks, "block_fp16_bytes": blocks_fp16})
        finally:
            c.down()
    lines.append("   shipped: every byte the prefill node sent for the request (blocks, the exact "
                 "fp32 window of the partial last chunk, headers); ratio: the whole prompt's KV "
                 "at fp16 over it; blocks only: the codec's own ratio over the full chunks")
    text = "\n".join(lines) + "\n"
    print(text)
    stem = write_results(args.out, "cluster_bench", now, commit, text, report)
    print("wrote %s.{txt,json}" % stem)


def e2e_stream(c, prompt, salt, max_tokens=2, temperature=0.0):
    return stream(c.base, prompt, max_tokens, salt, temperature, seed=3)


if __name__ == "__main__":
    main()
