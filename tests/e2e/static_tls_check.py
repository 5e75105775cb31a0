#!/usr/bin/env python3
"""Static thread-local storage of the serving programs, against the stacks it shares.

Every library a program loads at start keeps its thread-local storage inside each thread's
stack. civetweb (under prometheus-cpp, the metrics endpoint of every process) makes its threads
with stacks of 100 KiB, and a scrape needs about 32 KiB of it. OpenBLAS's 60 KiB, when the
programs linked it, left about 33 KiB: a decode node crashed on its first scrape once jemalloc
added 2.6 KiB (model/matmul.cc now opens OpenBLAS at first use). This check sums the TLS
segments of each program and of every library `ldd` lists for it, and fails above the limit.

  static_tls_check.py --build BUILD [--limit-kib 16]
"""
import argparse
import os
import re
import subprocess
import sys

PROGRAMS = ["kvstore/strata-store", "prefill_node/strata-prefill", "decode_node/strata-decode",
            "router/strata-router", "tools/strata"]


def tls_bytes(path):
    """The TLS segment's size in memory (0 without one), from readelf's program headers."""
    out = subprocess.run(["readelf", "-lW", path], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        fields = line.split()
        if fields and fields[0] == "TLS":
            return int(fields[5], 16)  # Type Offset VirtAddr PhysAddr FileSiz MemSiz ...
    return 0


def libraries(path):
    out = subprocess.run(["ldd", path], capture_output=True, text=True, check=True).stdout
    return sorted({m.group(1) for m in re.finditer(r"=> (/\S+)", out)})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    ap.add_argument("--limit-kib", type=float, default=16)
    args = ap.parse_args()
    failed = 0
    for rel in PROGRAMS:
        path = os.path.join(args.build, rel)
        if not os.path.exists(path):
            print(f"FAIL {rel}: not built")
            failed += 1
            continue
        parts = [(rel, tls_bytes(path))] + [(lib, tls_bytes(lib)) for lib in libraries(path)]
        total = sum(size for _, size in parts)
        largest = ", ".join(f"{os.path.basename(n)} {s}" for n, s in
                            sorted(parts, key=lambda p: -p[1])[:3] if s > 0)
        verdict = "ok" if total <= args.limit_kib * 1024 else "FAIL"
        failed += verdict == "FAIL"
        print(f"{verdict} {rel}: {total} bytes of static TLS (largest: {largest}); "
              f"limit {args.limit_kib:g} KiB")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
