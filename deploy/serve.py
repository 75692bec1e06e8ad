"""``kvroute serve``: Ray, the replica actors, the front door, uvicorn -- in one process.

Why one process: the router is light (an index, a policy, an HTTP loop) and the replicas
are Ray actors anyway; the driver owns them, so stopping ``kvroute serve`` (Ctrl-C) ends
them too. Progress goes to stderr while models load (tens of seconds on a CPU).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

RAY_NAMESPACE = "kvroute"  # where serve's replica actors are named r0, r1, ...


def add_arguments(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "--model",
        default="smollm2-135m",
        help="built-in name, HF folder, or sim:<profile> for cost-model replicas (sim:h100-8b)",
    )
    serve.add_argument(
        "--replicas", type=int, default=None, help="default: 2 locally, one per GPU on a cluster"
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--address", default=None, help="Ray cluster address (e.g. auto)")
    serve.add_argument(
        "--num-cpus-per-replica",
        type=float,
        default=None,
        help="Ray CPUs each replica reserves (default: 1; 0 for sim: replicas, which sleep)",
    )
    serve.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="sim: replicas only: wall seconds per modelled second of each step (e.g. 4: "
        "every step 4x slower, so a small CPU keeps up; divide latencies by it)",
    )
    serve.add_argument(
        "--num-gpus-per-replica", type=float, default=None, help="default: 1 if GPUs, else 0"
    )
    serve.add_argument("--num-blocks", type=int, default=None, help="KV blocks per replica")
    serve.add_argument("--block-size", type=int, default=16)
    serve.add_argument("--api-keys", default=None, help="file: JSON {key: tenant} or key:tenant")
    serve.add_argument("--fleet-secret", default=None, help="default: $KVROUTE_FLEET_SECRET")
    serve.add_argument("--policy", default="kv")
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument(
        "--max-in-flight",
        type=int,
        default=None,
        help="requests admitted at once; more get 429 (default: 128 per replica)",
    )
    serve.add_argument(
        "--max-in-flight-per-tenant",
        type=int,
        default=None,
        help="requests one tenant may hold at once; more get 429 (default: half of "
        "--max-in-flight when the API keys name two tenants or more, else no own cap)",
    )
    serve.add_argument(
        "--max-body-bytes",
        type=int,
        default=4 << 20,
        help="larger request bodies get 413 before they are read (default: 4 MiB)",
    )
    serve.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds for a request body to arrive whole; slower ones get 408 (default: 30)",
    )


def _say(msg: str) -> None:
    print(f"kvroute serve: {msg}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from kvroute.router.policy import POLICIES
    from kvroute.router.tenants import load_api_keys, resolve_fleet_secret

    if args.policy not in POLICIES:
        _say(f"unknown policy {args.policy!r}; choose from {', '.join(POLICIES)}")
        return 2
    try:
        keys = load_api_keys(args.api_keys) if args.api_keys else None
    except (OSError, ValueError) as exc:
        _say(f"--api-keys: {exc}")
        return 2
    if args.replicas is not None and args.replicas < 1:
        _say("--replicas must be >= 1")
        return 2
    from kvroute.replica.cost_model import sim_profile

    try:
        simulated = sim_profile(args.model) is not None
    except ValueError as exc:
        _say(str(exc))
        return 2
    if args.time_scale <= 0 or (args.time_scale != 1.0 and not simulated):
        _say("--time-scale must be > 0 and applies to sim: models only")
        return 2
    if args.num_cpus_per_replica is None:
        args.num_cpus_per_replica = 0.0 if simulated else 1.0
    secret = resolve_fleet_secret(args.fleet_secret)

    import ray

    try:
        return _run(args, keys, secret)
    except KeyboardInterrupt:
        _say("interrupted")
        return 130
    finally:
        if ray.is_initialized():
            ray.shutdown()


def _run(args: argparse.Namespace, keys: dict[str, str] | None, secret: str) -> int:
    import ray
    import uvicorn

    from kvroute.replica.actor import start_replica
    from kvroute.replica.cost_model import sim_profile
    from kvroute.router.frontdoor import FleetMismatchError, FrontDoor
    from kvroute.router.server import create_app
    from kvroute.router.tenants import Tenants

    if args.address:
        _say(f"joining the Ray cluster at {args.address}")
        ray.init(address=args.address, namespace=RAY_NAMESPACE, logging_level="warning")
        gpus = int(ray.cluster_resources().get("GPU", 0))
        n = args.replicas or gpus or 2
        num_gpus = args.num_gpus_per_replica if args.num_gpus_per_replica is not None else (
            1 if gpus and sim_profile(args.model) is None else 0
        )  # fmt: skip
        events_host = "0.0.0.0"
    else:
        n = args.replicas or 2
        num_gpus = args.num_gpus_per_replica or 0
        cpus = max(os.cpu_count() or 1, int(n * args.num_cpus_per_replica + 0.999))
        _say(f"starting a local Ray ({cpus} CPUs)")
        ray.init(
            num_cpus=cpus,
            namespace=RAY_NAMESPACE,
            include_dashboard=False,
            logging_level="warning",
        )
        events_host = "127.0.0.1"
    config: dict[str, Any] = {"model": args.model, "block_size": args.block_size}
    if args.time_scale != 1.0:
        config["time_scale"] = args.time_scale
    if args.num_blocks:
        config["num_blocks"] = args.num_blocks
    where = f"{num_gpus:g} GPU" if num_gpus else f"{args.num_cpus_per_replica:g} CPU"
    _say(f"starting {n} replica(s) of {args.model} ({where} each); loading the model...")
    t0 = time.monotonic()
    actors = [
        start_replica(
            f"r{i}",
            config,
            num_cpus=args.num_cpus_per_replica,
            num_gpus=num_gpus,
            events_host=events_host,
            name=f"r{i}",  # ray.get_actor("r0", namespace="kvroute") from another driver
        )
        for i in range(n)
    ]
    refs = {a.info.remote(): a for a in actors}
    infos: dict[Any, Any] = {}
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=15)
        if not done:
            _say(f"... {len(infos)}/{n} replicas ready after {time.monotonic() - t0:.0f} s")
            continue
        info = ray.get(done[0])  # raises the replica's own start-up error
        infos[refs[done[0]]] = info
        _say(
            f"replica {info.replica_id} ready on {info.node_ip} ({info.num_blocks} KV blocks, "
            f"max_model_len {info.max_model_len}) after {time.monotonic() - t0:.0f} s"
        )
    tokenizer = None
    if not Path(infos[actors[0]].model_path).is_dir():  # a replica on another node
        from transformers import AutoTokenizer

        from kvroute.replica.models import resolve_model

        tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
    max_in_flight = args.max_in_flight or 128 * n
    per_tenant = args.max_in_flight_per_tenant
    if per_tenant is None and len(set((keys or {}).values())) > 1:
        per_tenant = max(1, max_in_flight // 2)  # a flooding tenant leaves the others half
    try:
        door = FrontDoor(
            [(a, infos[a]) for a in actors],
            policy=args.policy,
            tokenizer=tokenizer,
            max_in_flight=max_in_flight,
            max_in_flight_per_tenant=per_tenant,
        )
    except FleetMismatchError as exc:
        _say(str(exc))
        return 2
    tenants = Tenants(keys, secret)
    app = create_app(
        door,
        tenants,
        args.served_model_name,
        max_body_bytes=args.max_body_bytes,
        body_timeout_s=args.body_timeout,
    )
    name = args.served_model_name or door.model
    auth = f"{len(keys)} API key(s)" if keys else "no API keys (every request is tenant default)"
    _say(
        f"ready: model {name!r} on http://{args.host}:{args.port}/v1 "
        f"({n} replicas, policy {args.policy}, {auth}); Ctrl-C stops"
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    _say("stopped")
    return 0
