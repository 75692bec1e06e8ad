"""``kvroute serve``: Ray, the replica actors, the front door, uvicorn -- in one command.

Why one command: the router is light (an index, a policy, an HTTP loop) and the replicas
are Ray actors anyway; the driver owns them, so stopping ``kvroute serve`` (Ctrl-C) ends
them too. Progress goes to stderr while models load (tens of seconds on a CPU).

``--routers N`` runs N front doors on one port: this process and N-1 ``kvroute router``
processes (see :mod:`.router`), each following every replica's events and load.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from .lora_args import LoRAFlagError, lora_settings
from .replica_config import engine_config
from .replica_config import pd_roles as _pd_roles
from .router import (
    RAY_NAMESPACE,
    REPLICA_ACTOR_PREFIX,
    build_app,
    describe_tenants,
    front_door_tenants,
    serve_app,
)
from .startup_cause import StartupError, root_cause

if TYPE_CHECKING:
    from kvroute.router.fleet.tenants import TenantsFile


def _say(msg: str) -> None:
    print(f"kvroute serve: {msg}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from .serve_checks import check_front_door

    try:
        if why := check_front_door(args):
            raise ValueError(why)
        spec = front_door_tenants(args)
    except ValueError as exc:
        _say(str(exc))
        return 2
    if why := _refused(args):
        _say(why)
        return 2
    from .http_server import listen_or_say

    # Before Ray starts: a busy port costs a line, not a fleet started for nothing.
    sock = listen_or_say(args.host, args.port, args.routers > 1, _say)
    if sock is None:
        return 2
    args.port = sock.getsockname()[1]  # --port 0: the one the kernel picked, for all doors

    import ray

    routers: list[subprocess.Popen[bytes]] = []
    try:
        return _run(args, spec, routers, sock)
    except StartupError as exc:
        _say(str(exc))
        return 2
    except KeyboardInterrupt:
        _say("interrupted")
        return 130
    finally:
        sock.close()
        for proc in routers:
            proc.terminate()
        for proc in routers:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        if ray.is_initialized():
            ray.shutdown()
        if getattr(args, "kv_disk_path", None) and not args.address:  # local replicas, ended
            from kvroute.replica.kv_tiers.disk import wipe_replica_folders

            wipe_replica_folders(args.kv_disk_path)  # their KV disk folders: tenants' data


def _refused(args: argparse.Namespace) -> str | None:
    """Why ``kvroute serve``'s flags are refused (None: they are not), before Ray starts;
    the flags whose defaults hang on others are resolved on ``args`` meanwhile (autoscaling,
    block size, CPUs per replica, LoRA, the JSON objects)."""
    from .serve_checks import check_serve

    if why := _pd_roles(args):
        return why
    if args.replicas is not None and args.replicas < 1:
        return "--replicas must be >= 1"
    if args.routers < 1:
        return "--routers must be >= 1"
    if why := _autoscale(args):
        return why
    for flag in ("max_num_batched_tokens", "max_num_seqs"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            return f"--{flag.replace('_', '-')} must be >= 1"
    from kvroute.replica.model.cost_model import sim_profile

    try:
        simulated = sim_profile(args.model) is not None
    except ValueError as exc:
        return str(exc)
    if not simulated and not args.address:  # a local fleet: the model is on this machine
        from kvroute.replica.model.models import check_model_name

        try:
            check_model_name(args.model)
        except ValueError as exc:
            return str(exc)
    if args.time_scale <= 0 or (args.time_scale != 1.0 and not simulated):
        return "--time-scale must be > 0 and applies to sim: models only"
    if args.engine == "vllm" and simulated:
        return "--engine vllm runs a real model: sim: models are kvroute's cost-model replicas"
    if args.vllm_args and args.engine != "vllm":
        return "--vllm-args applies to --engine vllm only"
    try:
        args.lora = lora_settings(args)
    except LoRAFlagError as exc:
        return str(exc)
    if args.lora and simulated:
        return "--enable-lora: sim: models are cost models, with no weights to adapt"
    if args.block_size is None:
        args.block_size = 32 if args.engine == "vllm" else 16
    if args.num_cpus_per_replica is None:
        args.num_cpus_per_replica = 0.0 if simulated else 1.0
    for flag in ("--resources-per-replica", "--runtime-env", "--vllm-args"):
        attr = flag[2:].replace("-", "_")
        try:
            setattr(args, attr, _json_object(getattr(args, attr)))
        except ValueError as exc:
            return f"{flag}: {exc}"
    return check_serve(args, simulated, lambda m: _say(f"warning: {m}"))


def _autoscale(args: argparse.Namespace) -> str | None:
    """``args.autoscale`` from the autoscaling flags (None: a fixed size), and
    ``args.replicas`` from them where not given; why they are refused (None: they are not)."""
    if args.max_replicas is not None:
        from .autoscale import AutoscaleConfig

        args.autoscale = AutoscaleConfig(
            args.min_replicas if args.min_replicas is not None else (args.replicas or 1),
            args.max_replicas,
            args.target_ongoing_requests,
            args.upscale_delay,
            args.downscale_delay,
        )
        if why := args.autoscale.check():
            return why
        if args.replicas is None:
            args.replicas = args.autoscale.min_replicas
        if not args.autoscale.min_replicas <= args.replicas <= args.autoscale.max_replicas:
            return "--replicas must lie between --min-replicas and --max-replicas"
        return None
    if args.min_replicas is not None:
        return "--min-replicas needs --max-replicas (autoscaling)"
    args.autoscale = None
    return None


def _json_object(text: str | None) -> dict[str, Any] | None:
    """A flag's JSON object (None when not given); ValueError for anything else."""
    if not text:
        return None
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value


def _start_ray(args: argparse.Namespace) -> tuple[int, float, str]:
    """(replicas, GPUs each, event bind host) once Ray is up."""
    import ray

    from kvroute.replica.model.cost_model import sim_profile

    if args.address:
        _say(f"joining the Ray cluster at {args.address}")
        ray.init(address=args.address, namespace=RAY_NAMESPACE, logging_level="warning")
        gpus = int(ray.cluster_resources().get("GPU", 0))
        n = args.replicas or gpus or 2
        num_gpus = args.num_gpus_per_replica if args.num_gpus_per_replica is not None else (
            1 if gpus and sim_profile(args.model) is None else 0
        )  # fmt: skip
        return n, num_gpus, "0.0.0.0"
    n = args.replicas or 2
    most = max(n, args.max_replicas or 0)  # autoscaling's room on this machine's own Ray
    cpus = max(os.cpu_count() or 1, int(most * args.num_cpus_per_replica + 0.999))
    # Ray (2.5x) turns token authentication on for a new local cluster and warns about it,
    # in words that read like a problem. It is the secure default: say so once ourselves.
    auth = os.environ.get("RAY_AUTH_MODE", "token")
    logging.getLogger("ray._private.authentication.authentication_token_setup").addFilter(
        lambda record: "Token authentication is enabled" not in record.getMessage()
    )
    _say(
        f"starting a local Ray ({cpus} CPUs; Ray token authentication: {auth}"
        + (
            ", token in ~/.ray/auth_token; RAY_AUTH_MODE=disabled opts out)"
            if auth == "token"
            else ")"
        )
    )
    ray.init(  # "local": a Ray of its own, never one found on this machine (ray start)
        address="local",
        num_cpus=cpus,
        namespace=RAY_NAMESPACE,
        include_dashboard=False,
        logging_level="warning",
    )
    return n, args.num_gpus_per_replica or 0, "127.0.0.1"


def _start_replicas(args: argparse.Namespace, n: int, num_gpus: float, events_host: str) -> Any:
    """The replica actors, named ``replica-r<i>``, once each has loaded its model.

    On a cluster (``--address``) they are detached: they outlive this process, and a
    front door started later (``kvroute serve`` again, ``kvroute router``) finds them by
    name; those already running are reused, not restarted. ``kvroute stop`` ends them."""
    import ray

    from kvroute.replica.serve.actor import start_replica

    detached = bool(args.address)
    existing = set(ray.util.list_named_actors()) if detached else set()

    config = engine_config(args)
    where = f"{num_gpus:g} GPU" if num_gpus else f"{args.num_cpus_per_replica:g} CPU"
    _say(f"starting {n} replica(s) of {args.model} ({where} each); loading the model...")
    t0 = time.monotonic()
    actors = []
    for i in range(n):
        name = f"{REPLICA_ACTOR_PREFIX}r{i}"  # how other front doors find it
        if name in existing:
            _say(f"reusing the running replica {name}")
            actors.append(ray.get_actor(name))
            continue
        extra: dict[str, Any] = {"lifetime": "detached"} if detached else {}
        if args.resources_per_replica:
            extra["resources"] = args.resources_per_replica
        if args.runtime_env:
            extra["runtime_env"] = args.runtime_env
        own = dict(config)
        if getattr(args, "roles", None):
            own["role"] = args.roles[i]
        if args.engine != "vllm" and args.kv_disk_path:  # a folder each: wiped at its start
            own["kv_disk_path"] = os.path.join(args.kv_disk_path, f"r{i}")
        actors.append(
            start_replica(
                f"r{i}",
                own,
                num_cpus=args.num_cpus_per_replica,
                num_gpus=num_gpus,
                events_host=events_host,
                name=name,
                **extra,
            )
        )
    refs = {a.info.remote(): a for a in actors}
    infos: dict[Any, Any] = {}
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=15)
        if not done:
            _say(f"... {len(infos)}/{n} replicas ready after {time.monotonic() - t0:.0f} s")
            continue
        try:
            info = ray.get(done[0])
        except ray.exceptions.RayError as exc:  # its traceback is in the log; its cause here
            raise StartupError(f"a replica failed to start: {root_cause(str(exc))}") from exc
        infos[refs[done[0]]] = info
        _say(
            f"replica {info.replica_id}{'' if info.role == 'both' else f' ({info.role})'} ready "
            f"on {info.node_ip} ({info.num_blocks} KV blocks, "
            f"max_model_len {info.max_model_len}) after {time.monotonic() - t0:.0f} s"
        )
    return [(a, infos[a]) for a in actors]


def _start_routers(args: argparse.Namespace, routers: list[subprocess.Popen[bytes]]) -> None:
    """N-1 more front doors on the same port; each reports ready on its stderr."""
    import ray

    from kvroute.router.fleet.tenants import METRICS_KEY_ENV

    address = ray.get_runtime_context().gcs_address
    same = [
        "--host", args.host, "--port", str(args.port), "--policy", args.policy,
        "--max-body-bytes", str(args.max_body_bytes), "--body-timeout", str(args.body_timeout),
        "--send-timeout", str(args.send_timeout),
    ]  # fmt: skip
    if args.log_requests:
        same.append("--log-requests")
    if args.allow_anonymous:
        same.append("--allow-anonymous")
    for flag, value in (
        ("--tenants", args.tenants),
        ("--api-keys", args.api_keys),
        ("--fleet-secret", args.fleet_secret),
        ("--metrics-key-file", args.metrics_key_file),
        ("--served-model-name", args.served_model_name),
        ("--max-in-flight", args.max_in_flight),
        ("--max-in-flight-per-tenant", args.max_in_flight_per_tenant),
        ("--admission-queue", args.admission_queue),
        ("--admission-timeout", args.admission_timeout),
        ("--flow-depth", getattr(args, "flow_depth", None)),
        ("--flow-tokens", getattr(args, "flow_tokens", None)),
        ("--max-waiting-per-priority", getattr(args, "max_waiting_per_priority", None)),
        ("--priority-header", getattr(args, "priority_header", None)),
    ):
        if value is not None:
            same += [flag, str(value)]
    cmd = [sys.executable, "-m", "kvroute.deploy.cli", "router", "--address", address]
    cmd += ["--namespace", RAY_NAMESPACE, "--reuse-port", *same]
    env = None  # --metrics-key by the environment: off their command lines
    if args.metrics_key is not None:
        env = {**os.environ, METRICS_KEY_ENV: args.metrics_key}
    for _ in range(args.routers - 1):
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, env=env)
        routers.append(proc)
        assert proc.stderr is not None
        for raw in proc.stderr:
            if b"ready on" in raw:
                break
        else:
            raise RuntimeError(f"a front door failed to start (exit {proc.wait()})")
        # Its later lines (warnings) go on to this stderr: a pipe nobody reads would fill
        # and stall the front door writing to it.
        threading.Thread(target=_relay, args=(proc.stderr,), daemon=True).start()


def _relay(stream: Any) -> None:
    for raw in stream:
        sys.stderr.buffer.write(raw)
        sys.stderr.flush()


def _run(
    args: argparse.Namespace,
    spec: TenantsFile | None,
    routers: list[subprocess.Popen[bytes]],
    sock: socket.socket,
) -> int:
    from kvroute.router.frontdoor import FleetMismatchError

    n, num_gpus, events_host = _start_ray(args)
    replicas = _start_replicas(args, n, num_gpus, events_host)
    try:
        app = build_app(args, replicas, spec)
    except FleetMismatchError as exc:
        _say(str(exc))
        return 2
    if args.routers > 1:
        _say(f"starting {args.routers - 1} more front door(s)")
        _start_routers(args, routers)
    name = args.served_model_name or replicas[0][1].model
    auth = describe_tenants(spec)
    doors = f", {args.routers} front doors" if args.routers > 1 else ""
    message = (
        f"ready: model {name!r} on http://{args.host}:{args.port}/v1 "
        f"({n} replicas, policy {args.policy}{doors}, {auth}); Ctrl-C stops"
    )
    import ray

    pd = getattr(args, "roles", None)
    sizes = "--prefill-replicas N --decode-replicas M" if pd else "--replicas N"
    scale = f"kvroute scale --address {ray.get_runtime_context().gcs_address} {sizes}"
    if not args.address and os.environ.get("RAY_AUTH_MODE", "token") == "token":
        scale = "RAY_AUTH_MODE=token " + scale  # another shell must send the token too

    flow = getattr(getattr(app.state, "door", None), "flow", None)

    def queued() -> int:  # this front door's waiting requests, read from the scaler's thread
        return flow.waiting if flow is not None else 0

    def announce() -> None:
        _say(message)
        _say(f"resize the fleet while it serves: {scale}")
        if args.autoscale is not None:
            c = args.autoscale
            _say(f"autoscaling: {c.min_replicas}-{c.max_replicas} replicas, "
                 f"{c.target_ongoing_requests:g} requests ongoing per replica")  # fmt: skip
            autoscaler.append(threading.Thread(
                target=run_autoscaler,
                args=(c, _say, stop_autoscaler),
                kwargs={"wait_for_resources": args.wait_for_resources, "queued": queued},
                name="kvroute-autoscaler",
                daemon=True,
            ))  # fmt: skip
            autoscaler[0].start()

    from .autoscale import run_autoscaler

    stop_autoscaler = threading.Event()
    autoscaler: list[threading.Thread] = []
    serve_app(app, sock, announce, args.body_timeout, say=_say)
    stop_autoscaler.set()
    for thread in autoscaler:  # a grow under way stops its replicas not ready yet
        thread.join(15)
    if args.address:
        _say("stopped; the replicas keep running (detached): `kvroute stop` ends them")
    else:
        _say("stopped")
    return 0
