#!/usr/bin/env python3
"""PyTorch's scaled_dot_product_attention (enable_gqa) on fp16 KV at cuda_decode_bench's shapes:
the reference our GPU decode kernels are held to. Head dim 128, 32 query heads over 8 KV heads,
one query token; batch 1 / 16 / 64, context 4k / 32k / 128k (128k up to batch 16). Median of runs
timed with CUDA events, L2 flushed before each; against a device-to-device copy in the same run
(bytes read plus written).

  bench/cuda_sdpa_bench.py [--out DIR] [--runs N] [--quick]
Needs PyTorch with CUDA (the lent GPU machines have it; this one does not: it says so, exits 1).
"""
import argparse
import datetime
import json
import os
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        print("cuda_sdpa_bench: no PyTorch here: nothing to measure", file=sys.stderr)
        return 1
    if not torch.cuda.is_available():
        print("cuda_sdpa_bench: no GPU here: nothing to measure", file=sys.stderr)
        return 1
    dev = torch.device("cuda")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)

    def timed(fn):
        times = []
        for r in range(args.runs + 3):
            flush.fill_(r & 0xFF)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            if r >= 3:
                times.append(a.elapsed_time(b))
        times.sort()
        return times[len(times) // 2]

    n = 1 << 30
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_ms = timed(lambda: dst.copy_(src))
    copy_gbps = 2.0 * n / (copy_ms * 1e-3) / 1e9
    del src, dst

    batches, contexts = ([16], [32768]) if args.quick else ([1, 16, 64], [4096, 32768, 131072])
    rows = []
    for batch in batches:
        for ctx in contexts:
            if ctx > 32768 and batch > 16:
                continue
            q = torch.randn(batch, 32, 1, 128, dtype=torch.float16, device=dev)
            k = torch.randn(batch, 8, ctx, 128, dtype=torch.float16, device=dev)
            v = torch.randn(batch, 8, ctx, 128, dtype=torch.float16, device=dev)
            ms = timed(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
            read = 2.0 * k.numel() * 2
            gbps = read / (ms * 1e-3) / 1e9
            rows.append({"batch": batch, "context": ctx, "ms": ms, "bytes": read, "gbps": gbps,
                         "of_copy": gbps / copy_gbps})
            del q, k, v
            torch.cuda.empty_cache()

    name = torch.cuda.get_device_name(0)
    date = datetime.date.today().isoformat()
    commit = os.environ.get("STRATA_COMMIT", "unknown")
    lines = ["cuda_sdpa_bench: %s, torch %s, %s, commit %s" % (name, torch.__version__, date, commit),
             "device-to-device copy: %.1f GB/s (read + write); SDPA (enable_gqa) on fp16 KV, "
             "head dim 128, 32 query heads over 8 KV heads" % copy_gbps, "",
             "%6s %8s %10s %10s %9s %9s" % ("batch", "context", "time ms", "MB read", "GB/s",
                                            "of copy")]
    for r in rows:
        lines.append("%6d %8d %10.4f %10.1f %9.1f %8.1f%%" % (
            r["batch"], r["context"], r["ms"], r["bytes"] / 1e6, r["gbps"], 100 * r["of_copy"]))
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        base = os.path.join(args.out, "cuda_sdpa_bench-%s-%s-%s" % (name.replace(" ", "_"), date,
                                                                    commit))
        with open(base + ".txt", "w") as f:
            f.write(text)
        with open(base + ".json", "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "date": date, "commit": commit,
                       "copy_gbps": copy_gbps, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
