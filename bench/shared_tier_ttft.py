#!/usr/bin/python3
"""TTFT on a hit from the shared tier against recomputing (issue "Beyond one store machine").

A cluster of two hosts on loopback (deploy/local/cluster.sh --host-stores --shared-tier 3: host I
runs prefill-I, decode-I and its own RAM-only store, a Redis Cluster of 3 masters behind them),
the bundled model. For each prompt size, N prompts of random token ids, each sent three times:

  recompute   first sight: nothing cached anywhere, the whole prompt prefilled;
  shared      after every store and node has been restarted (RAM-only stores come back empty,
              nodes lose whatever they held), so the prefix is only in the shared tier: the host's
              store promotes it from Redis and the prefill node adopts it;
  own store   the same prompt again: the host's store has it now.

Each request streams 4 tokens; TTFT is the time to the first token as the client sees it, its
cached_tokens from the response's usage. A warm-up request (another prompt) follows each
restart, so no row pays a process's first-request costs. Results go to
bench/results/shared_tier_ttft-DATE-COMMIT.{txt,json} with the machine, date and commit.

  bench/shared_tier_ttft.py [--sizes 1024,2000] [--prompts 5] [--build build]
Standard library only (Debian's /usr/bin/python3). Needs the built binaries and redis-server.
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))
import cluster_e2e_test as e2e  # noqa: E402  (the e2e tests' Cluster and metric helpers)
from cluster_bench import run_info, write_results  # noqa: E402  (results files' name and header)
import trace_replay  # noqa: E402  (its streamed request)


def send(c, prompt):
    """Streams 4 tokens of `prompt` (token ids): (ttft seconds, usage)."""
    r = trace_replay.send(c.base, prompt, 4, timeout=300)
    if "error" in r:
        raise RuntimeError(r["error"])
    return r["ttft"], r["usage"]


def restart_all(c):
    """Every store and node restarted: the stores empty (RAM only), the nodes' caches gone."""
    names = [n for n in c.pids() if n.startswith(("store", "prefill-", "decode-"))]
    for name in names:
        subprocess.run([os.path.join(ROOT, "deploy/local/cluster.sh"), "restart", name, "--dir",
                        c.dir], check=True, capture_output=True, timeout=120,
                       env=dict(os.environ, STRATA_BUILD_DIR=e2e.BUILD))
    deadline = time.monotonic() + 60
    for name in names:
        if name.startswith(("prefill-", "decode-")):
            while e2e.metric(e2e.scrape(c.spec["router"]["http"]), "strata_router_node_healthy",
                             'node="%s"' % name) != 1:
                if time.monotonic() > deadline:
                    raise RuntimeError("the router does not count %s healthy again" % name)
                time.sleep(0.2)
    return names


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--sizes", default="1024,2000", help="prompt tokens")
    ap.add_argument("--prompts", type=int, default=5, help="prompts per size")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = ap.parse_args()
    e2e.BUILD = os.path.abspath(args.build)
    cfg = json.load(open(os.path.join(e2e.MODEL, "config.json")))
    vocab_limit = min(t for t in (cfg.get("bos_token_id"), cfg.get("eos_token_id"),
                                  cfg["vocab_size"]) if t is not None)
    sizes = [int(s) for s in args.sizes.split(",")]
    rng = random.Random(1)
    prompts = {n: [[rng.randrange(vocab_limit) for _ in range(n)] for _ in range(args.prompts)]
               for n in sizes}
    warm = [rng.randrange(vocab_limit) for _ in range(64)]
    commit, now, machine = run_info()
    c = e2e.Cluster("kivi:k4v4:g32", prefill=2, decode=2,
                    extra=["--host-stores", "--shared-tier", "3", "--store-disk", "0",
                           "--shared-tier-memory", "512mb"])
    rows = {n: {"recompute": [], "shared": [], "own store": []} for n in sizes}
    try:
        send(c, warm)
        for n in sizes:
            for p in prompts[n]:
                rows[n]["recompute"].append(send(c, p))
        stores = [c.store_metrics(), "127.0.0.1:%d" % (c.port_base + 151)]
        for s in stores:
            e2e.wait_write_through(s)
        restarted = restart_all(c)
        send(c, warm[:48])
        for phase in ("shared", "own store"):
            for n in sizes:
                for p in prompts[n]:
                    rows[n][phase].append(send(c, p))
        promoted = sum(e2e.metric(e2e.scrape(s), "strata_store_shared_promoted_blocks_total")
                       for s in stores)
    except Exception:
        print(c.logs())
        raise
    finally:
        c.down()

    chunk = e2e.CHUNK
    lines = ["shared_tier_ttft  commit %s  %s  %s" % (commit, now.strftime("%Y-%m-%dT%H:%M:%SZ"),
                                                       machine),
             "cluster: 2 hosts on loopback (prefill-I, decode-I, a RAM-only store each) and a Redis "
             "Cluster of 3 masters (+ replicas) as the shared tier; codec kivi:k4v4:g32, %d-token "
             "chunks, bundled model; %d prompts per size, 4 streamed tokens each" % (
                 chunk, args.prompts),
             "restarted between the recompute and shared rows: %s; blocks promoted from the "
             "shared tier after the restart: %d" % (", ".join(restarted), promoted),
             "",
             "%-6s %-10s | %9s %9s %9s | %14s | %s" % ("tokens", "row", "TTFT p50", "min", "max",
                                                      "cached (mean)", "vs recompute")]
    report = {"commit": commit, "date": now.strftime("%Y-%m-%dT%H:%M:%SZ"), "machine": machine,
              "chunk_tokens": chunk, "prompts": args.prompts, "promoted_blocks": promoted,
              "rows": []}
    for n in sizes:
        base = statistics.median(t for t, _ in rows[n]["recompute"])
        for phase in ("recompute", "shared", "own store"):
            ttft = [t * 1e3 for t, _ in rows[n][phase]]
            cached = [u["prompt_tokens_details"]["cached_tokens"] for _, u in rows[n][phase]]
            med = statistics.median(ttft)
            lines.append("%-6d %-10s | %9.1f %9.1f %9.1f | %14.1f | %.2fx" % (
                n, phase, med, min(ttft), max(ttft), statistics.mean(cached), base * 1e3 / med))
            report["rows"].append({"tokens": n, "row": phase, "ttft_ms": ttft,
                                   "cached_tokens": cached, "ttft_p50_ms": med,
                                   "speedup_vs_recompute": base * 1e3 / med})
    lines += ["", "TTFT in ms as the client saw it; cached: the response's cached_tokens; "
              "vs recompute: the recompute row's median over this row's."]
    text = "\n".join(lines) + "\n"
    print(text)
    stem = write_results(args.out, "shared_tier_ttft", now, commit, text, report)
    print("wrote %s.{txt,json}" % stem)


if __name__ == "__main__":
    main()
