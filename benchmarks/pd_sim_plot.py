"""Plots ``benchmarks/pd_sim.py --json`` results side by side: per workload and ITL SLO, the
goodput of unified, the best fixed split and each conditional configuration, as a multiple
of unified's (issue 51's goals: a split at >= 2x on the tight SLO, conditional >= 1.0x on
the default one).

    python benchmarks/pd_sim_plot.py rag=/tmp/rag.json conversation=/tmp/conv.json \\
        --out benchmarks/figures/pd_goodput.png
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pd_sim import kind  # a configuration's kind: unified, split or conditional


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="+", help="label=file.json (pd_sim.py --json)")
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--conditional", default="unified:priced,4P4D:pair", help="conditional configs to show"
    )
    args = ap.parse_args(argv)
    shown = [c for c in args.conditional.split(",") if c]
    bars: dict[str, dict[str, float]] = {}  # "workload, ITL" -> series -> x unified
    for item in args.inputs:
        label, path = item.split("=", 1)
        with open(path) as f:
            rows = json.load(f)["limits"]
        by_slo: dict[float, dict[str, float]] = defaultdict(dict)
        for r in rows:
            by_slo[r["slo_itl_s"]][r["config"]] = r["goodput_rps"]
        for itl, g in sorted(by_slo.items()):
            base = g.get("unified", 0.0)
            if not base:
                continue
            key = f"{label}\nITL p90 <= {itl * 1e3:g} ms\n(unified {base:.1f} req/s)"
            splits = {c: v for c, v in g.items() if kind(c) == "split"}
            series: dict[str, float] = {"unified": 1.0}
            if splits:
                best = max(splits, key=lambda c: splits[c])
                series[f"best split ({best})"] = splits[best] / base
            for c in shown:
                if c in g:
                    series[c] = g[c] / base
            bars[key] = series
    names: list[str] = []
    for series in bars.values():
        for s in series:
            if s.split(" (")[0] not in [n.split(" (")[0] for n in names]:
                names.append(s)
    fig, ax = plt.subplots(figsize=(max(8, 2.2 * len(bars)), 4.8))
    width = 0.8 / max(len(names), 1)
    for j, name in enumerate(names):
        stem = name.split(" (")[0]
        xs, ys, labels = [], [], []
        for i, series in enumerate(bars.values()):
            for s, v in series.items():
                if s.split(" (")[0] == stem:
                    xs.append(i + (j - (len(names) - 1) / 2) * width)
                    ys.append(v)
                    labels.append(s[len(stem) :].strip(" ()"))
        rects = ax.bar(xs, ys, width, label=stem)
        for rect, lab, v in zip(rects, labels, ys, strict=True):
            ax.annotate(f"{v:.2f}" + (f"\n{lab}" if lab else ""), (rect.get_x() + width / 2, v),
                        ha="center", va="bottom", fontsize=6)  # fmt: skip
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.axhline(2.0, color="red", lw=0.8, ls=":", label="goal: split 2x (tight SLO)")
    ax.set_xticks(range(len(bars)), list(bars), fontsize=7)
    ax.set_ylabel("goodput, x unified (same 8 h100-8b replicas)")
    ax.set_title("P/D in the simulator: goodput at TTFT p90 <= 2 s, by ITL SLO (issue 51)")
    ax.legend(fontsize=7, loc="upper right")
    ax.set_ylim(0, 2.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=130)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
