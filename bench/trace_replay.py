#!/usr/bin/python3
"""A Mooncake trace replayed against a live Strata cluster (deploy/local/cluster.sh), next to
`strata replay`'s model of the same trace and store size; results go to
bench/results/trace_replay-DATE-COMMIT.{txt,json} with the machine, date and commit.

Scaling to the bundled model (context 2,048 tokens) and this machine: each of the trace's
512-token hash blocks becomes --block_tokens tokens (the cluster's chunk size: one block per
chunk), prompts keep at most as many whole blocks as fit the context, input and output lengths
scale by the same factor (outputs capped by --max_output, generated to the end: ignore_eos), and
arrival times are divided by --speedup. Each hash id maps to a fixed block of token ids, so equal
ids are equal prefixes and the cluster's chunk keys reuse exactly what the trace reuses. The
scaled trace is written next to the results: it is what `strata replay` models, with the same
chunk size, the model's KV shape, the cluster's codec and the store's RAM size (no disk tier in
either), policy s3fifo (the store's).

Store layouts (--layouts, issue "Beyond one store machine"): `central` (one store for the
cluster), `per-host` (cluster.sh --host-stores: host I runs prefill-I and decode-I and uses its
own store), `shared-tier` (per-host stores and a Redis Cluster of --shared_masters masters behind
them, --shared_memory each); the model runs `strata replay --layouts` over as many hosts as the
cluster has prefill nodes, with the tier's total memory.

What may separate the two: the cluster serves requests concurrently (a request that arrives while
an earlier one with its prefix is still in prefill misses, as in any serving system), its decode
nodes also store the chunks of generated text (more bytes competing for the RAM tier), and its
block sizes are the real ones, headers included.

  bench/trace_replay.py [--trace F] [--requests 500] [--store_ram 512M,16M] [--speedup 2]
                        [--layouts central,per-host,shared-tier] [--shared_memory 64mb]
Standard library only (Debian's /usr/bin/python3). Needs the built binaries.
"""
import argparse
import concurrent.futures
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))
import cluster_e2e_test as e2e  # noqa: E402  (the e2e tests' Cluster and metric helpers)
from cluster_bench import run_info, write_results  # noqa: E402  (results files' name and header)

TRACE = os.path.join(ROOT, "..", "shared", "data", "traces", "mooncake_conversation_trace.jsonl")
MOONCAKE_BLOCK = 512


def scale_trace(path, n, block, context, max_output):
    """The first n requests, scaled (see the module doc)."""
    out = []
    with open(path) as f:
        for line in f:
            if len(out) == n:
                break
            r = json.loads(line)
            output = max(1, min(max_output, round(r["output_length"] * block / MOONCAKE_BLOCK)))
            fits = (context - output) // block  # whole blocks that fit with the output
            ids = r["hash_ids"][:fits]
            tokens = round(r["input_length"] * block / MOONCAKE_BLOCK)
            tokens = max((len(ids) - 1) * block + 1, min(tokens, len(ids) * block))
            out.append({"timestamp": r["timestamp"], "input_length": tokens,
                        "output_length": output, "hash_ids": ids})
    return out


def block_tokens(hash_id, block, vocab_limit):
    rng = random.Random(hash_id * 1000003 + 7)
    return [rng.randrange(vocab_limit) for _ in range(block)]


def prompt_of(r, block, vocab_limit):
    tokens = []
    for h in r["hash_ids"]:
        tokens += block_tokens(h, block, vocab_limit)
    return tokens[:r["input_length"]]


def send(base, prompt, max_tokens, timeout):
    """One streamed completion: dict with ttft, total, usage or error."""
    body = {"model": "strata-tiny", "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    first, usage = None, None
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return {"error": str(event["error"].get("message", event["error"]))}
                if first is None and event.get("choices"):
                    first = time.monotonic()
                if event.get("usage"):
                    usage = event["usage"]
    except (urllib.error.URLError, OSError, ValueError) as e:
        return {"error": str(e)}
    if usage is None:
        return {"error": "no usage (stream ended early)"}
    end = time.monotonic()
    return {"ttft": (first or end) - t0, "total": end - t0, "usage": usage}


def pct(values, p):
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def parse_bytes(text):
    """'64mb', '512M', '1G' -> bytes."""
    t = text.strip().lower().rstrip("b")
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}.get(t[-1:], 1)
    return int(float(t[:-1] if t[-1:] in "kmgt" else t) * mult)


def model_hit_rate(build, scaled_path, block, cfg, codec, ram, layout="central", hosts=1,
                   shared_bytes=0, prefill_rate=0):
    out = subprocess.run(
        [os.path.join(build, "tools/strata"), "replay", "--trace", scaled_path,
         "--trace_block_tokens", str(block), "--model_layers", str(cfg["num_hidden_layers"]),
         "--model_kv_heads", str(cfg["num_key_value_heads"]),
         "--model_head_dim", str(cfg["head_dim"]), "--codecs", codec, "--ram_sizes", ram,
         "--disk_size", "0", "--policies", "s3fifo", "--layouts", layout, "--hosts", str(hosts),
         "--shared_size", str(shared_bytes), "--host_prefill_tokens_per_s", str(prefill_rate)],
        capture_output=True, text=True, check=True).stdout
    # "codec bits chunkMB RAM disk policy layout | chunk% token% ..."
    row = [line for line in out.splitlines()
           if line.startswith(codec + " ") and line.split("|", 1)[0].split()[-1] == layout][-1]
    right = row.split("|", 1)[1].split()
    return float(right[1].rstrip("%")) / 100, out


def layout_flags(layout, args):
    if layout == "per-host":
        return ["--host-stores"]
    if layout == "shared-tier":
        return ["--host-stores", "--shared-tier", str(args.shared_masters),
                "--shared-tier-memory", args.shared_memory]
    return []


def redis_stats(c, masters):
    """The shared tier's masters, summed: keys, bytes used (all, dataset), evictions, expiries."""
    total = {"masters": 0, "keys": 0, "used_memory": 0, "used_memory_dataset": 0,
             "evicted_keys": 0, "expired_keys": 0}
    host = c.address_of("redis")
    for i in range(2 * masters):
        def info(section, port=c.port_base + 200 + i):
            out = subprocess.run(["redis-cli", "-h", host, "-p", str(port), "INFO", section],
                                 capture_output=True, text=True, timeout=10).stdout
            return dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        if info("replication").get("role") != "master":
            continue
        total["masters"] += 1
        memory, stats, keyspace = info("memory"), info("stats"), info("keyspace")
        for k in ("used_memory", "used_memory_dataset"):
            total[k] += int(memory.get(k, 0))
        for k in ("evicted_keys", "expired_keys"):
            total[k] += int(stats.get(k, 0))
        db = keyspace.get("db0", "")
        total["keys"] += int(db.split(",")[0].split("=")[1]) if db.startswith("keys=") else 0
    return total


def replay_once(args, scaled, vocab_limit, ram, layout="central"):
    c = e2e.Cluster(args.codec, prefill=args.prefill, decode=args.decode, chunk=args.block_tokens,
                    extra=["--store-ram", ram, "--store-disk", "0",
                           "--router-flag", "--max_in_flight=1024"] + layout_flags(layout, args))
    results = [None] * len(scaled)
    try:
        t_start = time.monotonic()
        t0_trace = scaled[0]["timestamp"]
        sem = threading.Semaphore(args.concurrency)

        def run(i):
            try:
                results[i] = send(c.base, prompt_of(scaled[i], args.block_tokens, vocab_limit),
                                  scaled[i]["output_length"], args.timeout)
            finally:
                sem.release()

        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            for i, r in enumerate(scaled):
                due = t_start + (r["timestamp"] - t0_trace) / 1000 / args.speedup
                delay = due - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                sem.acquire()
                pool.submit(run, i)
        wall = time.monotonic() - t_start
        store = e2e.scrape(c.spec["store_metrics"]) if "store_metrics" in c.spec else {}
        if layout == "shared-tier":
            store["redis"] = redis_stats(c, args.shared_masters)
    finally:
        c.down()
    return results, wall, store


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--block_tokens", type=int, default=32)
    ap.add_argument("--max_output", type=int, default=64)
    ap.add_argument("--speedup", type=float, default=2.0)
    ap.add_argument("--concurrency", type=int, default=64, help="most requests in flight")
    ap.add_argument("--store_ram", default="512M,16M", help="RAM tier sizes, one run each")
    ap.add_argument("--codec", default="kivi:k4v4:g32")
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--layouts", default="central",
                    help="store layouts, one run each: central, per-host, shared-tier")
    ap.add_argument("--shared_masters", type=int, default=3, help="shared tier: Redis masters")
    ap.add_argument("--shared_memory", default="64mb", help="shared tier: each master's maxmemory")
    ap.add_argument("--model_prefill_tokens_per_s", type=float, default=0,
                    help="the model's router load term (strata replay "
                         "--host_prefill_tokens_per_s); 0: overlap alone")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--netns", default="",
                    help="every host in a network namespace of its own (cluster.sh --netns; "
                         "root): blocks between hosts cross real interfaces")
    args = ap.parse_args()
    e2e.BUILD = os.path.abspath(args.build)
    if args.netns:
        e2e.enter_hub(args.netns)  # runs this script again in the hub namespace
        e2e.NETNS, e2e.HERE = args.netns, e2e.HUB_ADDRESS
    cfg = json.load(open(os.path.join(e2e.MODEL, "config.json")))
    context = cfg["max_position_embeddings"]
    vocab_limit = min(t for t in (cfg.get("bos_token_id"), cfg.get("eos_token_id"),
                                  cfg["vocab_size"]) if t is not None)

    commit, now, machine = run_info()
    stem = os.path.join(args.out, "trace_replay-%s-%s" % (now.strftime("%Y-%m-%d"), commit))
    os.makedirs(args.out, exist_ok=True)

    scaled = scale_trace(args.trace, args.requests, args.block_tokens, context, args.max_output)
    scaled_path = stem + ".scaled.jsonl"
    with open(scaled_path, "w") as f:
        for r in scaled:
            f.write(json.dumps(r) + "\n")
    span = (scaled[-1]["timestamp"] - scaled[0]["timestamp"]) / 1000
    report = {"commit": commit, "date": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
              "machine": machine,
              "trace": os.path.basename(args.trace), "requests": len(scaled),
              "block_tokens": args.block_tokens, "max_output": args.max_output,
              "speedup": args.speedup, "codec": args.codec, "prefill": args.prefill,
              "decode": args.decode, "scaled_trace": os.path.basename(scaled_path), "runs": []}
    lines = [
        "trace_replay  commit %s  %s  %s" % (commit, report["date"], report["machine"]),
        "trace %s: first %d requests (%.0f s of arrivals, replayed %.1fx faster); 512-token "
        "hash blocks -> %d tokens; prompts %d tokens mean, outputs %d mean (ignore_eos)" % (
            report["trace"], len(scaled), span, args.speedup, args.block_tokens,
            statistics.mean(r["input_length"] for r in scaled),
            statistics.mean(r["output_length"] for r in scaled)),
        "cluster: store(s) (RAM tier only) + %d prefill + %d decode + router on %s, codec "
        "%s, %d-token chunks, bundled model; scaled trace: %s" % (
            args.prefill, args.decode,
            "network namespaces (a host each)" if args.netns else "loopback", args.codec,
            args.block_tokens, os.path.relpath(scaled_path, ROOT)),
        "layouts: %s; per-host and shared-tier: %d hosts (host I: prefill-I, decode-I, its own "
        "store); shared tier: %d Redis masters (+ replicas) of %s each" % (
            args.layouts, args.prefill, args.shared_masters, args.shared_memory),
        "",
        "%-6s %-11s | %7s %8s %6s | %9s %9s | %8s %8s %8s | %8s %8s | %7s %7s" % (
            "RAM", "layout", "sent", "errors", "wall s", "token hit", "model hit", "TTFT p50",
            "p90", "p99", "E2E p50", "p99", "req/s", "out t/s"),
    ]
    report["layouts"] = args.layouts
    report["shared_masters"] = args.shared_masters
    report["shared_memory"] = args.shared_memory
    report["model_prefill_tokens_per_s"] = args.model_prefill_tokens_per_s
    for ram, layout in [(r, l) for r in args.store_ram.split(",")
                        for l in args.layouts.split(",")]:
        model_hit, model_out = model_hit_rate(
            args.build, scaled_path, args.block_tokens, cfg, args.codec, ram, layout,
            args.prefill, args.shared_masters * parse_bytes(args.shared_memory),
            args.model_prefill_tokens_per_s)
        results, wall, store = replay_once(args, scaled, vocab_limit, ram, layout)
        ok = [r for r in results if r and "error" not in r]
        errors = [r["error"] for r in results if not r or "error" in r]
        prompt = sum(r["usage"]["prompt_tokens"] for r in ok)
        cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in ok)
        out_tokens = sum(r["usage"]["completion_tokens"] for r in ok)
        ttft = [r["ttft"] * 1e3 for r in ok]
        total = [r["total"] * 1e3 for r in ok]
        hit = cached / prompt if prompt else 0.0
        lines.append("%-6s %-11s | %7d %8d %6.1f | %8.2f%% %8.2f%% | %8.1f %8.1f %8.1f | %8.1f "
                     "%8.1f | %7.2f %7.1f" % (ram, layout, len(results), len(errors), wall,
                                              100 * hit,
                                       100 * model_hit, pct(ttft, 50), pct(ttft, 90),
                                       pct(ttft, 99), pct(total, 50), pct(total, 99),
                                       len(ok) / wall, out_tokens / wall))
        report["runs"].append({
            "store_ram": ram, "layout": layout, "sent": len(results), "errors": len(errors),
            "error_samples": errors[:5], "wall_s": wall, "prompt_tokens": prompt,
            "cached_tokens": cached, "token_hit_rate": hit, "model_token_hit_rate": model_hit,
            "completion_tokens": out_tokens,
            "ttft_ms": {p: pct(ttft, p) for p in (50, 90, 99)},
            "e2e_ms": {p: pct(total, p) for p in (50, 90, 99)},
            "requests_per_s": len(ok) / wall, "output_tokens_per_s": out_tokens / wall,
            "model_output": model_out, "redis": store.get("redis")})
        print(lines[-1], flush=True)
        if store.get("redis"):
            print("  shared tier:", store["redis"], flush=True)
        for e in errors[:5]:
            print("  error:", e)
    lines += ["", "token hit: cached prompt tokens / prompt tokens over the run, from each "
              "response's usage; model hit: `strata replay` on the scaled trace, same chunk, "
              "codec, RAM size and layout, s3fifo, no disk. TTFT and E2E: ms as the client saw them."]
    text = "\n".join(lines) + "\n"
    print(text)
    write_results(args.out, "trace_replay", now, commit, text, report)
    print("wrote %s.{txt,json,scaled.jsonl}" % stem)


if __name__ == "__main__":
    main()
