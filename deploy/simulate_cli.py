"""``kvroute simulate``: its arguments, and the run from parsed arguments to a table.

Its own module because it is most of the ``kvroute`` command's lines and none of its other
subcommands': :mod:`kvroute.deploy.cli` declares the command and dispatches here, as it
does to :mod:`.serve` and :mod:`.router`. The simulator itself is imported only when the
command runs.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvroute.sim.simulator import SimConfig


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``simulate`` subcommand and its arguments, on ``kvroute``'s subparsers."""
    sim = sub.add_parser(
        "simulate",
        help="replay a trace or a built-in workload on a simulated fleet, per routing policy",
        description="Discrete-event fleet simulation with the engine's real block pool, "
        "real KV events and the real prefix index and policies.",
    )
    src = sim.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="Mooncake jsonl trace (timestamp, hash_ids, ...)")
    src.add_argument("--workload", choices=("tenants", "chat", "rag", "agents", "lora"))
    sim.add_argument("--replicas", type=int, default=8)
    sim.add_argument(
        "--blocks-per-replica", type=int, default=None, help="KV blocks (default: profile's)"
    )
    sim.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="tokens per KV block (default: 512 for traces, their granularity; 64 otherwise)",
    )
    sim.add_argument(
        "--policy",
        default="kv,round_robin,random,least_loaded,approx_text",
        help="comma-separated: kv, round_robin, random, least_loaded, approx_text, "
        "kv_tier_blind (kv counting host copies as device hits), lora_affinity (most "
        "resident adapter wins, as llm-d), kv:lora_blind (kv ignoring adapters in its "
        "price); a name ending in :nohost runs on the fleet without its host tier "
        "(kv:nohost: device-only kv); kv:fetch: kv on a fleet whose replicas may pull a "
        "prefix from another one's cache (prefix fetch, at --link-gbps); pooled: no "
        "policy but the whole fleet as one "
        "replica of its summed resources, what no router can beat",
    )
    sim.add_argument(
        "--profile",
        default="h100-8b",
        help="cost-model profile; comma-separated for a mixed fleet, replica i running the "
        "i-th modulo their number (h100-8b,a100-8b: half of each)",
    )
    sim.add_argument("--speed", type=float, default=1.0, help="arrival-rate multiplier")
    sim.add_argument("--limit", type=int, default=None, help="first K requests")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--event-delay-ms", type=float, default=5.0)
    sim.add_argument("--event-loss", type=float, default=0.0, help="fraction of batches lost")
    sim.add_argument("--kv-ttl", type=float, default=None, help="prediction TTL (s)")
    host = sim.add_mutually_exclusive_group()
    host.add_argument(
        "--host-kv-blocks",
        type=int,
        default=None,
        help="a host KV tier per replica of N blocks: device evictions are copied there, "
        "and a prefix found there is loaded, not recomputed (default: no host tier)",
    )
    host.add_argument(
        "--host-kv-multiple",
        type=float,
        default=None,
        metavar="X",
        help="a host KV tier per replica of X times its device blocks",
    )
    sim.add_argument(
        "--host-bandwidth-gbps",
        type=float,
        default=None,
        help="host link GB/s each way (default: the profile's, h100-8b 48, a100-8b 24)",
    )
    sim.add_argument(
        "--adapters",
        type=int,
        default=None,
        metavar="N",
        help="LoRA adapters: N of them, one per tenant (its salt, else its conversation or "
        "task), Zipf-popular (--adapter-zipf); the lora workload's own count (default 64)",
    )
    sim.add_argument("--adapter-zipf", type=float, default=1.0, metavar="S",
                     help="adapters' Zipf popularity exponent (default 1.0)")  # fmt: skip
    sim.add_argument("--max-loras", type=int, default=4, help="adapter slots per replica")
    sim.add_argument("--max-cpu-loras", type=int, default=16,
                     help="adapters in host memory per replica (default 16)")  # fmt: skip
    sim.add_argument("--lora-rank", type=int, default=16,
                     help="adapters' rank, on all 7 projections (their load's bytes)")  # fmt: skip
    sim.add_argument("--no-bounds", action="store_true", help="skip ceiling and pooled bound")
    sim.add_argument(
        "--prefill-replicas",
        type=int,
        default=0,
        metavar="N",
        help="P/D: the first N replicas only prefill, handing each request off after its "
        "first token (default 0: no roles)",
    )
    sim.add_argument(
        "--decode-replicas",
        type=int,
        default=0,
        metavar="M",
        help="P/D: the next M replicas only decode requests handed off to them (pulling the "
        "prompt's blocks); the rest of --replicas do both",
    )
    sim.add_argument(
        "--pd-split",
        choices=("priced", "always", "pair"),
        default=None,
        help="P/D: split a request only when the router's price says it pays (priced: "
        "conditional disaggregation, the default with roles), or every one that can split "
        "(always); pair: priced, and a request that stays whole may run on any replica. "
        "Without --prefill/--decode-replicas: every replica does both and a request may "
        "split between any two (off unless given)",
    )
    sim.add_argument(
        "--link-gbps",
        type=float,
        default=50.0,
        help="P/D: each replica's link for KV pulls, GB/s each way (default 50: one 400 Gb/s "
        "NIC per GPU)",
    )
    sim.add_argument("--link-latency-ms", type=float, default=1.0,
                     help="P/D: a pull's latency on top of its bytes (default 1 ms)")  # fmt: skip
    sim.add_argument(
        "--flow-depth",
        type=int,
        default=0,
        metavar="N",
        help="flow control in the front door, as `kvroute serve --flow-depth` (its default "
        "16): requests wait at the door while every replica has N of them without a first "
        "token, then are routed among those with room (default 0: off, routed on arrival)",
    )
    sim.add_argument(
        "--flow-tokens",
        type=int,
        default=0,
        metavar="T",
        help="flow control: ... or T of their prompt tokens (default 0: no bound, as "
        "`kvroute serve`)",
    )
    sim.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=0,
        help="the engines' per-request prompt chunk cap, as `kvroute serve` (0: none)",
    )
    sim.add_argument(
        "--max-num-partial-prefills",
        type=int,
        default=0,
        help="the engines' prompts part-way per tenant, as `kvroute serve` (0: no limit)",
    )
    sim.add_argument(
        "--sweep-speed",
        default=None,
        metavar="S1,S2,...|auto",
        help="goodput: run every policy at each speed and report the highest rate meeting "
        "the SLO (--slo-ttft, --slo-itl); auto: search each policy's limit (double from "
        "1x until it fails, then bisect to within 10%%)",
    )
    sim.add_argument("--slo-ttft", type=float, default=2.0, help="SLO: TTFT p90 (s)")
    sim.add_argument("--slo-itl", type=float, default=0.1, help="SLO: inter-token p90 (s)")
    sim.add_argument(
        "--sustained",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --sweep-speed: a rate counts as goodput only if every replica could keep "
        "up with it (util <= 1), not only while a finite run's backlog drains after the "
        "last arrival (default: on)",
    )
    sim.add_argument("--json", action="store_true", help="print one JSON object")
    sim.add_argument("--plot", default=None, metavar="FILE.png", help="needs matplotlib")
    sim.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)


def _sweep(args: argparse.Namespace, policies: list[str], cfg: Any, progress: Any) -> int:
    import json

    from kvroute.sim.goodput import find_limits, format_sweep, plot_sweep, sweep
    from kvroute.sim.traces import load_mooncake, specs_from_trace
    from kvroute.sim.workloads import make_workload

    auto = args.sweep_speed.strip() == "auto"
    try:
        speeds = [] if auto else [float(s) for s in args.sweep_speed.split(",") if s.strip()]
        if not auto and (not speeds or min(speeds) <= 0):
            raise ValueError("--sweep-speed needs speeds > 0, or auto")
        trace = load_mooncake(args.trace, args.limit) if args.trace else None
    except (OSError, ValueError) as e:
        print(f"kvroute simulate: {e}", file=sys.stderr)
        return 2

    def specs(speed: float) -> list[Any]:
        if trace is not None:
            return _with_adapters(args, specs_from_trace(trace, speed))
        return make_workload(
            args.workload, args.limit or 4000, args.seed, speed, args.adapters, args.adapter_zipf
        )

    if auto:
        result = find_limits(
            specs, policies, cfg, args.slo_ttft, args.slo_itl, progress, sustained=args.sustained
        )
    else:
        result = sweep(
            specs, speeds, policies, cfg, args.slo_ttft, args.slo_itl, progress, args.sustained
        )
    if args.plot:
        src = args.trace.rsplit("/", 1)[-1] if args.trace else args.workload
        plot_sweep(result, args.plot, f"{src}, {args.replicas} replicas: latency vs rate")
    print(json.dumps(result, indent=1) if args.json else format_sweep(result))
    return 0


def _with_adapters(args: argparse.Namespace, specs: list[Any]) -> list[Any]:
    """A trace's requests with --adapters assigned per tenant (none asked: as they are)."""
    from kvroute.sim.workloads import assign_adapters

    if not args.adapters:
        return specs
    return assign_adapters(specs, args.adapters, args.adapter_zipf, args.seed)


def run(args: argparse.Namespace) -> int:
    """Check the arguments, simulate each policy (or sweep the rate), print the result."""
    import json

    from kvroute.replica.model.cost_model import PROFILES
    from kvroute.router.routing.policies import POLICIES
    from kvroute.sim.report import format_table, simulate, stderr_progress, to_json
    from kvroute.sim.simulator import POOLED, split_policy
    from kvroute.sim.traces import load_mooncake, specs_from_trace
    from kvroute.sim.workloads import make_workload

    policies = [p.strip() for p in args.policy.split(",") if p.strip()]

    def known(name: str) -> bool:
        try:
            return split_policy(name)[0] in (*POLICIES, POOLED)
        except ValueError:
            return False

    bad = [p for p in policies if not known(p)]
    if bad or not policies:
        print(f"kvroute simulate: unknown policy {bad}; choose from {POLICIES}", file=sys.stderr)
        return 2
    profiles = [p.strip() for p in args.profile.split(",") if p.strip()]
    unknown = [p for p in profiles if p not in PROFILES]
    if unknown or not profiles:
        print(f"kvroute simulate: unknown profile {unknown}; choose from {list(PROFILES)}",
              file=sys.stderr)  # fmt: skip
        return 2
    if any(v is not None and v < 0 for v in (args.host_kv_blocks, args.host_kv_multiple)) or (
        args.host_bandwidth_gbps is not None and args.host_bandwidth_gbps <= 0
    ):
        print("kvroute simulate: host tier sizes must be >= 0 and its bandwidth > 0",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("kvroute simulate: --plot needs matplotlib (pip install matplotlib)",
                  file=sys.stderr)  # fmt: skip
            return 2
    try:
        if args.adapters is not None and args.adapters < 1:
            raise ValueError("--adapters must be >= 1")
        if args.max_loras < 1 or args.max_cpu_loras < args.max_loras or args.lora_rank < 1:
            raise ValueError("--max-loras must be >= 1, --max-cpu-loras >= --max-loras, "
                             "--lora-rank >= 1")  # fmt: skip
        if min(args.prefill_replicas, args.decode_replicas) < 0 or (
            args.prefill_replicas + args.decode_replicas > args.replicas
        ):
            raise ValueError("--prefill-replicas and --decode-replicas must be >= 0 and "
                             "together at most --replicas")  # fmt: skip
        if args.link_gbps <= 0 or args.link_latency_ms < 0:
            raise ValueError("--link-gbps must be > 0 and --link-latency-ms >= 0")
        if args.trace:
            trace_specs = specs_from_trace(load_mooncake(args.trace, args.limit), args.speed)
            specs = _with_adapters(args, trace_specs)
        else:
            specs = make_workload(
                args.workload, args.limit or 4000, args.seed, args.speed,
                args.adapters, args.adapter_zipf,
            )  # fmt: skip
    except (OSError, ValueError) as e:
        print(f"kvroute simulate: {e}", file=sys.stderr)
        return 2
    cfg = _sim_config(args, profiles)
    show = args.progress if args.progress is not None else sys.stderr.isatty()
    if args.sweep_speed:
        return _sweep(args, policies, cfg, stderr_progress if show else None)
    result = simulate(
        specs, policies, cfg, stderr_progress if show else None, with_bounds=not args.no_bounds
    )
    result["workload"]["source"] = args.trace or args.workload
    result["workload"]["speed"] = args.speed
    if args.plot:
        from kvroute.sim.report import plot

        src = args.trace.rsplit("/", 1)[-1] if args.trace else args.workload
        plot(result, args.plot, f"{src}, {args.replicas} replicas, speed {args.speed}")
    if args.json:
        print(json.dumps(to_json(result), indent=1))
    else:
        print(format_table(result))
    return 0


def _sim_config(args: argparse.Namespace, profiles: list[str]) -> SimConfig:
    """The simulated fleet ``kvroute simulate``'s flags describe (checked by :func:`run`)."""
    import dataclasses

    from kvroute.replica.model.cost_model import PROFILES
    from kvroute.sim.lora import LoRAConfig
    from kvroute.sim.simulator import SimConfig

    kv_params = {k: v for k, v in (("prediction_ttl_s", args.kv_ttl),) if v is not None}
    return SimConfig(
        replicas=args.replicas,
        blocks_per_replica=args.blocks_per_replica,
        block_size=args.block_size or (512 if args.trace else 64),
        profiles=tuple(
            PROFILES[p]
            if args.host_bandwidth_gbps is None
            else dataclasses.replace(PROFILES[p], host_bandwidth=args.host_bandwidth_gbps * 1e9)
            for p in profiles
        ),
        event_delay_s=args.event_delay_ms / 1000.0,
        event_loss=args.event_loss,
        seed=args.seed,
        kv_params=kv_params,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_num_partial_prefills=args.max_num_partial_prefills,
        host_blocks_per_replica=args.host_kv_blocks,
        host_kv_multiple=args.host_kv_multiple,
        lora=LoRAConfig(args.max_loras, args.max_cpu_loras, args.lora_rank)
        if args.adapters or args.workload == "lora"
        else None,
        prefill_replicas=args.prefill_replicas,
        decode_replicas=args.decode_replicas,
        pd_split="always" if args.pd_split == "always" else "priced",
        pd_pair=args.pd_split == "pair"
        or (args.pd_split is not None and not (args.prefill_replicas or args.decode_replicas)),
        link_bytes_per_s=args.link_gbps * 1e9,
        link_latency_s=args.link_latency_ms / 1000.0,
        flow_depth=args.flow_depth or None,
        flow_tokens=args.flow_tokens or None,
    )
