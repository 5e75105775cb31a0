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
    fig, axes = plt.subplots(1, 2, figsize=(15, 6))
    panels = [("perplexity_change_percent", "perplexity change vs fp16 KV (%)", False),
              ("kl_to_fp16_nats", "KL divergence from fp16 KV (nats per token, log scale)", True)]
    for ax, (key, label, log) in zip(axes, panels):
        points = [(c["bits_per_element"], c[key], c["codec"])
                  for c in report["codecs"] if c["codec"] != "fp16" and key in c and "error" not in c]
        front, best = [], float("inf")
        for bits, d, name in sorted(points):
            if d < best:
                front.append((bits, d))
                best = d
        colors = {}
        for bits, d, name in points:
            fam = family(name)
            if fam not in colors:
                colors[fam] = "C%d" % len(colors)
            ax.scatter(bits, d, color=colors[fam], s=40 if fam != "strata" else 90,
                       marker="o" if fam != "strata" else "*", zorder=3)
            ax.annotate(name, (bits, d), fontsize=5, xytext=(3, 3), textcoords="offset points")
        ax.plot([b for b, _ in front], [d for _, d in front], "k--", lw=0.8, zorder=2,
                label="Pareto front")
        for fam, col in colors.items():
            ax.scatter([], [], color=col, label=fam)
        if log:
            ax.set_yscale("log")
        else:
            ax.axhline(0, color="grey", lw=0.5)
        ax.set_xlabel("bits per element (K and V, all metadata)")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle("KV codecs on %s (%d tokens, context %d)" % (
        report["model"].rstrip("/").split("/")[-1], report["scored_tokens"], report["context"]))
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=130)
    print("wrote", sys.argv[2])


if __name__ == "__main__":
    main()
