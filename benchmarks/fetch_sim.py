"""Prefix fetch in the simulator: kv against kv with fetch, each policy's limit at one or more
TTFT SLOs, side by side in one run, and a plot of TTFT p90 against the arrival rate.

    python benchmarks/fetch_sim.py --workload agents --slo-ttft 2,1,0.5

For each TTFT SLO it runs ``kvroute simulate --policy kv,kv:fetch --sweep-speed auto
--slo-ttft S --json`` (8 h100-8b replicas, the simulator's default link of 50 GB/s each way,
``--link-gbps`` to change it) and prints each policy's goodput (the highest rate meeting
the SLO with the fleet keeping up) and their ratio (issue 51's goal: kv with fetch >= 1.2x
kv without, where hot prefixes saturate their holders). The plot (``--plot``) shows TTFT
p90 at every rate both sweeps ran, the SLOs as lines.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def sweep(workload: str, slo: float, extra: list[str]) -> dict:
    cmd = [
        sys.executable, "-m", "kvroute.deploy.cli", "simulate", "--workload", workload,
        "--policy", "kv,kv:fetch", "--sweep-speed", "auto", "--slo-ttft", str(slo),
        "--json", "--no-progress", *extra,
    ]  # fmt: skip
    print("+ " + " ".join(cmd[2:]), file=sys.stderr, flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="agents")
    ap.add_argument("--slo-ttft", default="2,0.5", help="comma-separated seconds")
    ap.add_argument("--link-gbps", type=float, default=None)
    ap.add_argument("--plot", default=None, metavar="FILE.png")
    args = ap.parse_args()
    extra = ["--link-gbps", str(args.link_gbps)] if args.link_gbps else []
    runs = {float(s): sweep(args.workload, float(s), extra) for s in args.slo_ttft.split(",")}
    print(f"{args.workload}, 8 x h100-8b, kv against kv with prefix fetch (--sweep-speed auto)")
    print(f"{'TTFT SLO':>9} {'kv req/s':>9} {'kv:fetch':>9} {'ratio':>6} {'ceiling':>8}")
    for slo, r in runs.items():
        g = r["goodput_rps"]
        kv, fetch = g.get("kv") or 0.0, g.get("kv:fetch") or 0.0
        ratio = fetch / kv if kv else float("inf")
        ceiling = r["ceiling"]["rate_rps"]
        print(f"{slo:>8g}s {kv:>9.2f} {fetch:>9.2f} {ratio:>5.2f}x {ceiling:>8.2f}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.2))
        points: dict[str, dict[float, float]] = {}
        for r in runs.values():
            for row in r["rows"]:
                points.setdefault(row["policy"], {})[row["rate_rps"]] = row["ttft_p90_s"]
        for policy, pts in points.items():
            xs = sorted(pts)
            ax.plot(xs, [pts[x] for x in xs], marker="o", label=policy)
        for slo in runs:
            ax.axhline(slo, color="grey", lw=0.8, ls="--")
        ax.axvline(next(iter(runs.values()))["ceiling"]["rate_rps"], color="k", lw=0.8, ls=":")
        ax.set_xlabel("arrival rate, req/s (dotted: the throughput ceiling)")
        ax.set_ylabel("TTFT p90, s (dashed: the SLOs)")
        ax.set_title(f"prefix fetch, {args.workload}, 8 x h100-8b (simulator)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
