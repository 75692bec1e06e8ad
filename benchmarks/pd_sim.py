"""P/D disaggregation in the simulator (issue 51): each fleet configuration's goodput at
one or more SLOs, side by side, for one workload and one replica count.

    python benchmarks/pd_sim.py --trace traces/mooncake_conversation_trace.jsonl --limit 2000 \\
        --configs unified,2P6D,3P5D,4P4D,5P3D,2P6D:priced,4P4D:priced --slo-itl 0.05,0.1

A configuration: ``unified`` (no roles), ``<P>P<D>D`` (P prefill replicas, D decode
replicas, the rest of ``--replicas`` both; every splittable request splits), with
``:priced`` for conditional disaggregation (a request splits only when the router's
``split_pays`` says so); ``unified:priced`` every replica both, a request split between any
two when the router's ``best_pair`` says it pays (``unified:always``: every request splits,
its decode on the policy's choice among the others); ``4P4D:pair`` pools priced as
``:priced`` whose prefill replicas also run whole requests where that is cheapest. Each
configuration's limit per SLO is searched as ``kvroute simulate --sweep-speed auto``
searches a policy's (``sim.goodput.search_limit``: double from 1x until the SLO is missed,
then bisect to within 10%; a rate counts only if the busiest replica keeps up, util <= 1); a
run at one speed serves every SLO's search. Prints, per SLO, each configuration's goodput,
its ratio to unified's, and what its limit's run looked like; then the best unified, split and
conditional configurations.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from typing import Any

from kvroute.router.routing import fetch as router_fetch
from kvroute.sim.goodput import _counts, _sweep_row, search_limit
from kvroute.sim.report import simulate
from kvroute.sim.simulator import SimConfig
from kvroute.sim.traces import load_mooncake, specs_from_trace
from kvroute.sim.workloads import make_workload

_CONFIG = re.compile(r"^(?:unified|(\d+)P(?:(\d+)D)?)(?::(priced|always|pair))?$")


def parse_config(name: str) -> dict[str, Any]:
    """``unified``: no P/D; ``unified:priced`` / ``unified:always``: every replica both, a
    request split between any two (``SimConfig.pd_pair``); ``<P>P<D>D[:split]``: pools."""
    m = _CONFIG.match(name)
    if m is None:
        raise ValueError(
            f"unknown configuration {name!r} (unified, unified:priced, 2P6D, 2P6D:priced)"
        )
    prefill, decode = int(m[1] or 0), int(m[2] or 0)
    pair = m[3] == "pair" or (not (prefill or decode) and m[3] is not None)
    split = "always" if m[3] == "always" or (m[3] is None and (prefill or decode)) else "priced"
    return {"prefill_replicas": prefill, "decode_replicas": decode, "pd_split": split,
            "pd_pair": pair}  # fmt: skip


def kind(name: str) -> str:
    if name == "unified":
        return "unified"
    return "conditional" if name.endswith((":priced", ":pair")) else "split"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace")
    src.add_argument("--workload", choices=("tenants", "chat", "rag", "agents"))
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--configs", default="unified,2P6D,3P5D,4P4D,2P6D:priced,4P4D:priced")
    ap.add_argument("--slo-ttft", type=float, default=2.0)
    ap.add_argument("--slo-itl", default="0.05,0.1", help="comma-separated ITL p90 SLOs (s)")
    ap.add_argument("--link-gbps", type=float, default=50.0, help="the simulated link, GB/s")
    ap.add_argument(
        "--router-link-gbps",
        type=float,
        default=None,
        help="what if the router priced splits at this link speed (GB/s) where a decode "
        "replica has measured no pull yet, instead of DEFAULT_LINK_BYTES_PER_S (1 GB/s)",
    )
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the rows here")
    args = ap.parse_args(argv)

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if args.router_link_gbps is not None:
        router_fetch.DEFAULT_LINK_BYTES_PER_S = args.router_link_gbps * 1e9  # split_pays reads it
    itls = [float(x) for x in args.slo_itl.split(",") if x.strip()]
    trace = load_mooncake(args.trace, args.limit) if args.trace else None
    cache: dict[float, Any] = {}

    def specs(speed: float) -> Any:
        if speed not in cache:
            if trace is not None:
                cache[speed] = specs_from_trace(trace, speed)
            else:
                cache[speed] = make_workload(args.workload, args.limit or 4000, args.seed, speed)
        return cache[speed]

    block = 512 if trace is not None else 64
    runs: dict[tuple[str, float], dict[str, Any]] = {}  # (config, speed) -> the run's row

    def row(name: str, speed: float) -> dict[str, Any]:
        key = (name, speed)
        if key not in runs:
            cfg = SimConfig(
                replicas=args.replicas, block_size=block, link_bytes_per_s=args.link_gbps * 1e9,
                **parse_config(name),
            )  # fmt: skip
            s = specs(speed)
            t0 = time.perf_counter()
            m = simulate(s, ["kv"], cfg, with_bounds=False)["policies"]["kv"]
            r = _sweep_row(name, speed, s, m, args.slo_ttft, max(itls))
            pd = m.get("pd")
            r["split_fraction"] = pd["split_fraction"] if pd else 0.0
            r["pull_s_mean"] = pd["pull_s_mean"] if pd else 0.0
            r["pull_queue_s_mean"] = pd["pull_queue_s_mean"] if pd else 0.0
            r["wall_s"] = time.perf_counter() - t0
            runs[key] = r
            print(
                f"  {name:<12} x{speed:<7.3g} {r['rate_rps']:6.2f} req/s  TTFT p90 "
                f"{r['ttft_p90_s']:7.2f} s  ITL p90 {r['itl_p90_s'] * 1e3:7.1f} ms  util "
                f"{r['utilization']:5.2f}  split {r['split_fraction']:.2f}  "
                f"({r['wall_s']:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
        return runs[key]

    def meets(r: dict[str, Any], itl: float) -> bool:
        ok = r["ttft_p90_s"] <= args.slo_ttft and r["itl_p90_s"] <= itl
        return _counts({**r, "meets_slo": ok}, True)

    limits: dict[float, dict[str, tuple[float | None, float | None]]] = {}
    for itl in itls:
        limits[itl] = {}
        for name in configs:
            ok, fail = search_limit(lambda v, n=name, i=itl: meets(row(n, v), i))
            limits[itl][name] = (ok, fail)

    def rate(speed: float | None) -> float:
        if speed is None:
            return 0.0
        s = specs(speed)
        return len(s) / max(s[-1].arrival_s - s[0].arrival_s, 1e-9)

    src_name = args.trace.rsplit("/", 1)[-1] if args.trace else args.workload
    n = len(specs(1.0))
    out_rows = []
    for itl in itls:
        print(
            f"\n{src_name} ({n} requests), {args.replicas} h100-8b replicas, link "
            f"{args.link_gbps:g} GB/s (the router prices "
            f"{router_fetch.DEFAULT_LINK_BYTES_PER_S / 1e9:g}); SLO TTFT p90 <= "
            f"{args.slo_ttft:g} s, ITL p90 <= "
            f"{itl * 1e3:g} ms (util <= 1)"
        )
        head = (
            f"{'config':<14}{'goodput':>9}{'speed':>8}{'x unified':>10}{'TTFT p90':>10}"
            f"{'ITL p90':>9}{'split':>7}{'pull':>8}   missed at"
        )
        print(head)
        print("-" * len(head))
        base = rate(limits[itl].get("unified", (None, None))[0]) if "unified" in configs else 0
        for name in configs:
            ok, fail = limits[itl][name]
            g = rate(ok)
            r = runs[(name, ok)] if ok is not None else None
            ratio = f"{g / base:.2f}x" if base else "-"
            miss = "none up to 256x" if fail is None else f"{fail:.3g}x ({rate(fail):.2f} req/s)"
            if r is None:
                print(f"{name:<14}{0:>9.2f}{'-':>8}{ratio:>10}{'':>42}   {miss}")
            else:
                print(
                    f"{name:<14}{g:>9.2f}{ok:>7.3g}x{ratio:>10}{r['ttft_p90_s']:>9.2f}s"
                    f"{r['itl_p90_s'] * 1e3:>7.1f}ms{r['split_fraction']:>7.2f}"
                    f"{r['pull_s_mean'] * 1e3:>6.1f}ms   {miss}"
                )
            out_rows.append({"slo_itl_s": itl, "config": name, "goodput_rps": g,
                             "speed_ok": ok, "speed_fail": fail})  # fmt: skip
        best: dict[str, tuple[str, float]] = {}
        for name in configs:
            g, k = rate(limits[itl][name][0]), kind(name)
            if k not in best or g > best[k][1]:
                best[k] = (name, g)
        u = best.get("unified", ("-", 0.0))[1]
        parts = [
            f"{k} {best[k][0]} {best[k][1]:.2f} req/s"
            + (f" ({best[k][1] / u:.2f}x unified)" if u and k != "unified" else "")
            for k in ("unified", "split", "conditional")
            if k in best
        ]
        print("best: " + "; ".join(parts))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"limits": out_rows, "runs": [dict(r) for r in runs.values()]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
