#!/usr/bin/env python3
"""Draws a `strata replay --json` report: prompt-token hit rate against RAM size, one line per
codec x disk tier x eviction policy. Needs matplotlib (scripts/setup_training.sh installs it).

    /usr/bin/python3 tools/replay_chart.py REPORT.json OUT.png
"""
import json
import sys


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(sys.argv[1]) as f:
        rep = json.load(f)
    series = {}
    for r in rep["runs"]:
        key = (r["codec"], r["disk_bytes"], r["policy"])
        series.setdefault(key, []).append((r["ram_bytes"] / 2**30, 100 * r["token_hit_rate"]))
    fig, ax = plt.subplots(figsize=(9, 6))
    codecs = sorted({k[0] for k in series})
    for (codec, disk, policy), pts in sorted(series.items()):
        pts.sort()
        color = "C%d" % (codecs.index(codec) * 2 + (1 if disk else 0))
        label = "%s, %s, %s" % (codec, "RAM + %d TiB disk" % (disk / 2**40) if disk else "RAM only",
                                policy)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color,
                ls="-" if policy == "s3fifo" else "--", marker="o", ms=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("RAM tier (GiB)")
    ax.set_ylabel("prompt tokens served from the store (%)")
    ax.set_title("%s: %d requests, %d-layer x %d KV heads x %d dims, %d-token chunks" % (
        rep["trace"].split("/")[-1], rep["requests"], rep["layers"], rep["kv_heads"],
        rep["head_dim"], rep["block_tokens"]), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=130)
    print("wrote", sys.argv[2])


if __name__ == "__main__":
    main()
