"""Policies compared at one rate over several runs: how often each meets the SLO there.

    python benchmarks/limit_runs.py --workload agents --blocks-per-replica 500 \
        --host-kv-multiple 4 --rate 5.35 --policy kv,kv_tier_blind,kv:nohost

Why: near a policy's limit the SLO verdict of one run flips with a change of the arrival
times far below the goodput search's step (agents at 5.35 req/s: one policy's TTFT p90
1.15-3.04 s over runs 0.4% apart), so two policies whose searched limits differ by one
step may not differ at all, and two that tie may. Here each policy runs ``--runs`` times at
speeds spread ``--step`` apart around the rate (the same arrivals for every policy), and
the table gives, per policy, the runs that meet the SLO, the median TTFT p90 and
inter-token p90, the mean hit rate and preemptions. The fleet is ``kvroute simulate``'s
(8 ``h100-8b`` replicas, its block sizes and defaults).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys

from kvroute.replica.cost_model import PROFILES
from kvroute.sim.goodput import SLO_ITL_P90_S, SLO_TTFT_P90_S
from kvroute.sim.report import simulate
from kvroute.sim.simulator import SimConfig
from kvroute.sim.traces import load_mooncake, specs_from_trace
from kvroute.sim.workloads import RequestSpec, make_workload


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="Mooncake jsonl trace")
    src.add_argument("--workload", choices=("tenants", "chat", "rag", "agents", "lora"))
    ap.add_argument("--limit", type=int, default=4000, help="first K requests")
    ap.add_argument("--rate", type=float, required=True, help="req/s the runs centre on")
    ap.add_argument("--policy", default="kv,kv_tier_blind")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--step", type=float, default=0.004, help="relative speed between runs")
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--blocks-per-replica", type=int)
    ap.add_argument("--host-kv-multiple", type=float)
    ap.add_argument("--host-bandwidth-gbps", type=float)
    ap.add_argument("--profile", default="h100-8b")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    trace = load_mooncake(args.trace, args.limit) if args.trace else None

    def specs_at(speed: float) -> list[RequestSpec]:
        if trace is not None:
            return specs_from_trace(trace, speed)
        return make_workload(args.workload, args.limit, args.seed, speed)

    base = specs_at(1.0)
    rate_1x = len(base) / (base[-1].arrival_s - base[0].arrival_s)
    centre = args.rate / rate_1x
    speeds = [centre * (1 + args.step * (k - (args.runs - 1) / 2)) for k in range(args.runs)]
    profile = PROFILES[args.profile]
    if args.host_bandwidth_gbps is not None:
        profile = dataclasses.replace(profile, host_bandwidth=args.host_bandwidth_gbps * 1e9)
    cfg = SimConfig(
        replicas=args.replicas,
        blocks_per_replica=args.blocks_per_replica,
        block_size=512 if trace is not None else 64,
        profiles=(profile,),
        seed=args.seed,
        host_kv_multiple=args.host_kv_multiple,
    )
    policies = args.policy.split(",")
    runs: dict[str, list[dict[str, float]]] = {p: [] for p in policies}
    for i, speed in enumerate(speeds):
        print(f"run {i + 1}/{len(speeds)}: speed {speed:.4f}", file=sys.stderr)
        result = simulate(specs_at(speed), policies, cfg, with_bounds=False)
        for p, m in result["policies"].items():
            runs[p].append({
                "speed": speed, "ttft_p90_s": m["ttft_s"]["p90"], "itl_p90_s": m["itl_s"]["p90"],
                "hit_rate": m["hit_rate"], "preemptions": m["preemptions"],
            })  # fmt: skip

    def meets(r: dict[str, float]) -> bool:
        return r["ttft_p90_s"] <= SLO_TTFT_P90_S and r["itl_p90_s"] <= SLO_ITL_P90_S

    summary = {}
    for p, rs in runs.items():
        summary[p] = {
            "meets": sum(meets(r) for r in rs),
            "runs": len(rs),
            "ttft_p90_median_s": statistics.median(r["ttft_p90_s"] for r in rs),
            "itl_p90_median_s": statistics.median(r["itl_p90_s"] for r in rs),
            "hit_rate": statistics.mean(r["hit_rate"] for r in rs),
            "preemptions": statistics.mean(r["preemptions"] for r in rs),
            "each": rs,
        }
    if args.json:
        print(json.dumps({"rate_rps": args.rate, "speeds": speeds, "policies": summary}, indent=1))
        return 0
    slo = f"TTFT p90 <= {SLO_TTFT_P90_S:g} s, inter-token p90 <= {SLO_ITL_P90_S * 1e3:g} ms"
    print(f"{args.rate:g} req/s ({centre:.4f}x), {len(speeds)} runs {args.step:.1%} apart; {slo}")
    head = ("policy", "meets", "TTFT p90", "ITL p90", "hit", "preempt")
    print("{:16s} {:>6s} {:>9s} {:>8s} {:>6s} {:>8s}  TTFT p90 per run".format(*head))
    for p, s in summary.items():
        each = " ".join(f"{r['ttft_p90_s']:.2f}" for r in s["each"])
        print(f"{p:16s} {s['meets']:>3d}/{s['runs']:<2d} {s['ttft_p90_median_s']:8.2f}s "
              f"{s['itl_p90_median_s'] * 1e3:6.0f}ms {s['hit_rate']:6.3f} {s['preemptions']:8.1f}"
              f"  {each}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
