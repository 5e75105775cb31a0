#!/usr/bin/env python3
"""Draws the Pareto chart of a `strata eval --json` report: perplexity change against fp16 vs
bits per element (all metadata counted), one point per codec, the front of non-dominated codecs
joined by a line. Needs matplotlib (Debian: python3-matplotlib).

    /usr/bin/python3 tools/pareto_chart.py REPORT.json OUT.png
"""
import json
import sys


def family(codec):
    return codec.split(":")[0]


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(sys.argv[1]) as f:
        report = json.load(f)
    points = [(c["bits_per_element"], c["perplexity_change_percent"], c["codec"])
              for c in report["codecs"] if c["codec"] != "fp16"]
    front, best = [], float("inf")
    for bits, d, name in sorted(points):
        if d < best:
            front.append((bits, d))
            best = d
    fig, ax = plt.subplots(figsize=(9, 6))
    colors = {}
    for bits, d, name in points:
        fam = family(name)
        if fam not in colors:
            colors[fam] = "C%d" % len(colors)
        ax.scatter(bits, d, color=colors[fam], s=40 if fam != "strata" else 90,
                   marker="o" if fam != "strata" else "*", zorder=3)
        ax.annotate(name, (bits, d), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.plot([b for b, _ in front], [d for _, d in front], "k--", lw=0.8, zorder=2,
            label="Pareto front")
    for fam, col in colors.items():
        ax.scatter([], [], color=col, label=fam)
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_xlabel("bits per element (K and V, all metadata)")
    ax.set_ylabel("perplexity change vs fp16 KV (%)")
    ax.set_title("KV codecs on %s (%d tokens, context %d)" % (
        report["model"].rstrip("/").split("/")[-1], report["scored_tokens"], report["context"]))
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=130)
    print("wrote", sys.argv[2])


if __name__ == "__main__":
    main()
