"""Each policy's goodput as a share of the throughput ceiling, per workload, from saved
limit searches; and where "1.5x the best other policy" would have to be.

    python benchmarks/plot_ceiling.py --out benchmarks/figures/goodput_ceiling.png \\
        agents=agents.json tenants=tenants.json ...

Each FILE is the ``--json`` output of ``kvroute simulate ... --sweep-speed auto`` or of
``benchmarks/fresh_limits.py --json`` (both carry ``limits`` and the ``ceiling``,
:mod:`kvroute.sim.bounds`). A bar is a policy's goodput over the ceiling; a black tick is
1.5x the best policy other than kv, over the ceiling: above 100% no policy can reach it.
A run named ``pooled`` (``--policy ...,pooled``: the fleet as one replica, no router) is
drawn as the others but is not a policy: it is never the "best other", and the table adds
kv's goodput as a share of it. Prints the same figures as a table.
"""

from __future__ import annotations

import argparse
import json
import sys

POOLED = "pooled"  # kvroute.sim.simulator.POOLED: a run, not a policy


def load(path: str) -> dict:
    with open(path) as f:
        result = json.load(f)
    return result["limits"] if "ceiling" not in result else result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", metavar="NAME=FILE")
    ap.add_argument("--out", default=None, help="PNG (needs matplotlib)")
    ap.add_argument("--goal", type=float, default=1.5, help="the multiple of the best other")
    args = ap.parse_args()
    rows = []
    for spec in args.runs:
        name, _, path = spec.partition("=")
        r = load(path)
        ceiling = r["ceiling"]["rate_rps"]
        goodput = r["goodput_rps"]
        others = [g for p, g in goodput.items() if p != "kv" and p.partition(":")[0] != POOLED]
        best_other = max(others, default=0.0)
        rows.append((name, ceiling, goodput, best_other))
    policies = list(dict.fromkeys(p for _, _, g, _ in rows for p in g))
    pooled = POOLED in policies
    extra = " kv / pooled |" if pooled else ""
    print(f"| workload | ceiling req/s | {' | '.join(policies)} | kv / best other | "
          f"{args.goal:g}x best other / ceiling |{extra}")  # fmt: skip
    print("| --- | ---: | " + " | ".join("---:" for _ in policies) + " | ---: | ---: |"
          + (" ---: |" if pooled else ""))  # fmt: skip
    for name, ceiling, goodput, best in rows:
        cells = " | ".join(
            f"{goodput.get(p, 0.0):.1f} ({goodput.get(p, 0.0) / ceiling:.0%})" for p in policies
        )
        ratio = f"{goodput.get('kv', 0.0) / best:.2f}x" if best > 0 else "no other meets it"
        need = f"{args.goal * best / ceiling:.0%}" if best > 0 else "-"
        line = f"| {name} | {ceiling:.1f} | {cells} | {ratio} | {need} |"
        if pooled:
            share = goodput.get(POOLED, 0.0)
            line += f" {goodput.get('kv', 0.0) / share:.0%} |" if share > 0 else " - |"
        print(line)
    if args.out:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(max(7, 1.2 * len(rows) + 3), 4.5))
        width = 0.8 / len(policies)
        for k, p in enumerate(policies):
            xs = [i + (k - (len(policies) - 1) / 2) * width for i in range(len(rows))]
            ys = [100 * g.get(p, 0.0) / c for _, c, g, _ in rows]
            ax.bar(xs, ys, width, label=p)
        for i, (_, c, _, best) in enumerate(rows):
            if best > 0:
                y = 100 * args.goal * best / c
                ax.plot([i - 0.45, i + 0.45], [y, y], color="k", lw=2)
        ax.plot([], [], color="k", lw=2, label=f"{args.goal:g}x the best other")
        ax.axhline(100, color="k", ls="--", lw=1, label="throughput ceiling")
        ax.set_xticks(range(len(rows)), [r[0] for r in rows])
        ax.set_ylabel("goodput, % of the throughput ceiling")
        ax.set_title("Goodput (each policy's limit) against what no policy can sustain")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        ax.grid(True, axis="y", alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.out, dpi=110)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
