"""Each policy's limit on a workload generated fresh from a seed: a check that a routing
change generalises beyond the built-in workloads it was looked at on.

    python benchmarks/fresh_limits.py --seed 7 [--policy kv,approx_text,...] [--json]

The workload (:func:`fresh`) mixes the shapes of the built-in ones with every size, rate
and popularity drawn from the seed: applications with their own system prompts (zipf
popularity), retrieved documents from a per-application pool (zipf), and conversations
that resend their history for a few turns. For each policy it prints the limit that
``kvroute simulate --sweep-speed auto`` would (the same search, SLO and fleet: 8
``h100-8b`` replicas, 64-token blocks) and, at 0.5x the workload's rate, TTFT p90, e2e p90,
hit rate and work imbalance.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from kvroute.sim.goodput import SLO_ITL_P90_S, SLO_TTFT_P90_S, find_limits
from kvroute.sim.report import simulate
from kvroute.sim.simulator import SimConfig
from kvroute.sim.workloads import RequestSpec, _Ids, _poisson_times, _zipf_weights


def fresh(seed: int, n: int = 4000) -> tuple[list[RequestSpec], dict[str, float]]:
    """A workload whose parameters are drawn from ``seed``; returns it and the parameters."""
    rng, ids = np.random.default_rng(seed), _Ids()
    p = {
        "apps": int(rng.integers(8, 80)),
        "app_zipf": float(rng.uniform(0.6, 1.4)),
        "system_tokens_max": int(rng.integers(1024, 8192)),
        "docs_per_app": int(rng.integers(50, 800)),
        "doc_zipf": float(rng.uniform(0.8, 1.5)),
        "docs_max": int(rng.integers(0, 5)),
        "doc_tokens_max": int(rng.integers(400, 2500)),
        "turns_mean": float(rng.uniform(1.0, 5.0)),
        "output_max": int(rng.integers(128, 1024)),
        "rate": float(rng.uniform(4.0, 14.0)),
    }
    apps = []
    for _ in range(p["apps"]):
        system = (ids(), int(rng.integers(256, p["system_tokens_max"])))
        docs = [
            (ids(), int(rng.integers(200, p["doc_tokens_max"]))) for _ in range(p["docs_per_app"])
        ]
        apps.append((system, docs))
    app_w = _zipf_weights(p["apps"], p["app_zipf"])
    doc_w = _zipf_weights(p["docs_per_app"], p["doc_zipf"])
    out: list[RequestSpec] = []
    starts = _poisson_times(rng, n, p["rate"] / p["turns_mean"])
    for t in starts:
        system, docs = apps[int(rng.choice(p["apps"], p=app_w))]
        k = int(rng.integers(0, p["docs_max"] + 1))
        chosen = rng.choice(p["docs_per_app"], size=k, replace=False, p=doc_w) if k else []
        history = [system, *(docs[int(i)] for i in chosen)]
        at = float(t)
        for _ in range(int(rng.geometric(1 / p["turns_mean"]))):
            history.append((ids(), int(rng.integers(16, 512))))
            out_len = int(rng.integers(16, p["output_max"]))
            out.append(RequestSpec(at, tuple(history), out_len))
            history.append((ids(), out_len))
            at += 5.0 + rng.exponential(20.0)
        if len(out) >= n:
            break
    out.sort(key=lambda s: s.arrival_s)
    return out[:n], p


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--policy", default="kv,approx_text,least_loaded,round_robin,random")
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--sustained",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="as kvroute simulate's (default: on)",
    )
    args = ap.parse_args()
    policies = [s.strip() for s in args.policy.split(",") if s.strip()]
    base, params = fresh(args.seed, args.requests)

    def specs(speed: float) -> list[RequestSpec]:
        return [RequestSpec(s.arrival_s / speed, s.segments, s.output_length) for s in base]

    cfg = SimConfig(replicas=args.replicas, block_size=64, seed=0)
    limits = find_limits(
        specs, policies, cfg, SLO_TTFT_P90_S, SLO_ITL_P90_S, sustained=args.sustained
    )
    light = simulate(specs(0.5), policies, cfg, with_bounds=False)["policies"]
    half = {
        name: {
            "ttft_p90_s": m["ttft_s"]["p90"],
            "e2e_p90_s": m["e2e_s"]["p90"],
            "hit_rate": m["hit_rate"],
            "imbalance": m["imbalance"],
            "preemptions": m["preemptions"],
        }
        for name, m in light.items()
    }
    result = {"seed": args.seed, "params": params, "limits": limits, "half_speed": half}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"fresh workload, seed {args.seed}: {json.dumps(params)}")
    print("policy        limit req/s (speed)   0.5x: TTFT p90  e2e p90  hit   imbalance")
    for name in policies:
        lim, h = limits["limits"][name], half[name]
        print(
            f"{name:13s} {limits['goodput_rps'][name]:8.1f} ({lim['speed_ok'] or 0:.2f}x)"
            f"        {h['ttft_p90_s']:6.2f}  {h['e2e_p90_s']:7.2f}  {h['hit_rate']:.3f}"
            f"  {h['imbalance']:.2f}"
        )
    c = limits["ceiling"]
    print(f"throughput ceiling (no policy can sustain more): {c['rate_rps']:.1f} req/s "
          f"({c['speed']:.2f}x, {c['binding']}-bound)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
