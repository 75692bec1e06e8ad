"""Each adapter's TTFT p99 against its popularity, per policy: where an unfair tail sits.

    kvroute simulate --workload lora --limit 2000 --speed 2.8286 --policy kv,approx_text \
        --no-bounds --json --no-progress > run.json
    python benchmarks/plot_adapter_tail.py --out tail.png kv=run.json:kv \
        approx_text=run.json:approx_text

Why a plot: the fairness figure (the worst adapter's p99 over the median adapter's) is one
number from the coldest adapters' handful of requests; the plot shows which adapters make
it, and the line at three times the median each policy is held to.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def series(path: str, policy: str) -> list[tuple[int, float]]:
    """(requests, TTFT p99) per adapter of ``policy`` in a ``kvroute simulate --json``."""
    with open(path) as f:
        per = json.load(f)["policies"][policy]["ttft_by_adapter"]
    return sorted(((d["requests"], d["p99"]) for d in per.values()), reverse=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="PNG to write")
    ap.add_argument("--title", default="")
    ap.add_argument("runs", nargs="+", metavar="LABEL=FILE:POLICY")
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for k, spec in enumerate(args.runs):
        label, _, rest = spec.partition("=")
        path, _, policy = rest.rpartition(":")
        pts = series(path, policy)
        p99s = [p for _, p in pts]
        median = statistics.median(p99s)
        colour = f"C{k}"
        ax.plot(range(len(pts)), p99s, "o-", ms=3, lw=0.8, color=colour,
                label=f"{label}: worst {max(p99s) / median:.2f}x the median")  # fmt: skip
        ax.axhline(3 * median, color=colour, ls=":", lw=1)
        print(f"{label:24s} median adapter p99 {median:6.2f} s, worst {max(p99s):6.2f} s "
              f"({max(p99s) / median:.2f}x)")  # fmt: skip
    ax.set_xlabel("adapter, by requests (most popular first)")
    ax.set_ylabel("TTFT p99 (s)")
    ax.set_title(args.title or "TTFT p99 per adapter (dotted: 3x each policy's median)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
