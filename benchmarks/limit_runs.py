"""Policies compared at one rate over several runs: how often each meets the SLO there.

    python benchmarks/limit_runs.py --rate 5.35 --workload agents --blocks-per-replica 500 \
        --host-kv-multiple 4 --policy kv,kv_tier_blind,kv:nohost

Why: near a policy's limit the SLO verdict of one run flips with a change of the arrival
times far below the goodput search's step (agents at 5.35 req/s: kv's TTFT p90 1.48-2.97 s
over runs 0.4% apart), so two policies whose searched limits differ by one step may not
differ at all, and two that tie may. Here each policy runs ``--runs`` times at speeds
spread ``--step`` apart around the rate (the same arrivals for every policy), and the table
gives, per policy, the runs that meet the SLO, the median TTFT p90 and inter-token p90, the
mean hit rate and preemptions, and the busiest replica's median utilization (the sweep's
limit also needs it <= 1: the fleet keeps up).

Every other argument is ``kvroute simulate``'s (workload or trace, fleet, tiers, adapters,
SLO), and the runs are its ``--sweep-speed`` over those speeds: the same fleet and code.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
from typing import Any

from kvroute.deploy.cli import build_parser
from kvroute.deploy.simulate_cli import run as simulate


def rate_at_1x(args: argparse.Namespace) -> float:
    """The workload's arrival rate at speed 1, as ``kvroute simulate`` builds it."""
    from kvroute.sim.traces import load_mooncake, specs_from_trace
    from kvroute.sim.workloads import make_workload

    if args.trace:
        specs = specs_from_trace(load_mooncake(args.trace, args.limit), 1.0)
    else:
        specs = make_workload(args.workload, args.limit or 4000, args.seed, 1.0)
    return len(specs) / (specs[-1].arrival_s - specs[0].arrival_s)


def _adapter_summary(rs: list[dict[str, Any]]) -> dict[str, Any]:
    """With adapters: slot loads per 1,000 requests (median) and the worst adapter's TTFT
    p99 over the median adapter's, per run (a p99 over an adapter's few requests is near
    their maximum, so one run's spread is as chaotic as its verdict)."""
    if not rs or "adapter_p99_spread" not in rs[0]:
        return {}
    return {
        "adapter_loads_per_1k": statistics.median(r["adapter_loads_per_1k"] for r in rs),
        "adapter_p99_spread": [
            r["adapter_p99_spread"] for r in sorted(rs, key=lambda r: r["speed"])
        ],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, required=True, help="req/s the runs centre on")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--step", type=float, default=0.004, help="relative speed between runs")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ours, rest = ap.parse_known_args(argv)
    parser = build_parser()
    centre = ours.rate / rate_at_1x(parser.parse_args(["simulate", *rest]))
    speeds = [centre * (1 + ours.step * (k - (ours.runs - 1) / 2)) for k in range(ours.runs)]
    sweep = ["--sweep-speed", ",".join(repr(s) for s in speeds), "--json", "--no-progress"]
    args = parser.parse_args(["simulate", *rest, *sweep])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = simulate(args)
    if rc:
        return rc
    result = json.loads(out.getvalue())
    slo = result["slo"]
    runs: dict[str, list[dict[str, Any]]] = {}
    for row in result["rows"]:
        runs.setdefault(row["policy"], []).append(row)

    def meets(r: dict[str, Any]) -> bool:
        return r["ttft_p90_s"] <= slo["ttft_p90_s"] and r["itl_p90_s"] <= slo["itl_p90_s"]

    summary = {
        p: {
            "meets": sum(meets(r) for r in rs),
            "runs": len(rs),
            "ttft_p90_median_s": statistics.median(r["ttft_p90_s"] for r in rs),
            "itl_p90_median_s": statistics.median(r["itl_p90_s"] for r in rs),
            "hit_rate": statistics.mean(r["hit_rate"] for r in rs),
            "preemptions": statistics.mean(r["preemptions"] for r in rs),
            # the busiest replica's utilization; the sweep's limit also needs it <= 1
            "utilization_median": statistics.median(r["utilization"] for r in rs),
            "keeps_up": sum(r["keeps_up"] for r in rs),
            "ttft_p90_s": [r["ttft_p90_s"] for r in sorted(rs, key=lambda r: r["speed"])],
            **_adapter_summary(rs),
        }
        for p, rs in runs.items()
    }
    if ours.json:
        print(json.dumps({"rate_rps": ours.rate, "speeds": speeds, "policies": summary}, indent=1))
        return 0
    goal = f"TTFT p90 <= {slo['ttft_p90_s']:g} s, inter-token p90 <= {slo['itl_p90_s'] * 1e3:g} ms"
    print(f"{ours.rate:g} req/s ({centre:.4f}x), {len(speeds)} runs {ours.step:.1%} apart; {goal}")
    head = ("policy", "meets", "TTFT p90", "ITL p90", "hit", "preempt", "util")
    print("{:16s} {:>6s} {:>9s} {:>8s} {:>6s} {:>8s} {:>5s}  TTFT p90 per run".format(*head))
    for p, s in summary.items():
        each = " ".join(f"{t:.2f}" for t in s["ttft_p90_s"])
        print(f"{p:16s} {s['meets']:>3d}/{s['runs']:<2d} {s['ttft_p90_median_s']:8.2f}s "
              f"{s['itl_p90_median_s'] * 1e3:6.0f}ms {s['hit_rate']:6.3f} {s['preemptions']:8.1f}"
              f" {s['utilization_median']:5.2f}  {each}")  # fmt: skip
        if "adapter_p99_spread" in s:
            spread = " ".join(f"{x:.2f}" for x in s["adapter_p99_spread"])
            print(f"{'':16s} adapter loads per 1,000 {s['adapter_loads_per_1k']:.0f}; "
                  f"adapter TTFT p99 spread per run {spread}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
