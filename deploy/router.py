"""``kvroute router``: one more front door for a running fleet, in a process of its own.

Why separate processes: one front door is one Python event loop -- HTTP parsing, SSE
writing and Ray's streaming all share one core. More front doors add cores. Each one
joins the Ray cluster as a driver, finds the replicas by name (``replica-<id>`` in the
``kvroute`` namespace, as ``kvroute serve`` names them), subscribes to every replica's
event stream and polls every replica's load report, so it routes on the whole fleet's
cache and load, not only on the requests it sent itself. Front doors on one host share the
port with ``SO_REUSEPORT``: the kernel spreads connections over them.

``kvroute serve --routers N`` starts N-1 of these beside its own front door.

``kvroute router --backend URL=EVENTS_ENDPOINT[,REPLAY_ENDPOINT] ...`` fronts ``vllm serve``
processes kvroute did not start, with no Ray: each backend is read once at start-up
(served model, block size, hash algorithm: :mod:`kvroute.router.backends.control`), its KV
events indexed, its requests streamed over its own HTTP API
(:mod:`kvroute.router.backends.connection`). ``--prefill URL ... --decode URL ...`` pairs
``vllm serve`` backends started with a KV connector (NixlConnector) over vLLM's
``kv_transfer_params`` protocol (:mod:`kvroute.router.backends.pd`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import logging
import re
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvroute.router.fleet.tenants import TenantsFile
    from kvroute.router.lora.registry import FleetLoRAs

RAY_NAMESPACE = "kvroute"
REPLICA_ACTOR_PREFIX = "replica-"  # actor name = prefix + replica id


def say(msg: str) -> None:
    print(f"kvroute router: {msg}", file=sys.stderr, flush=True)


def front_door_tenants(args: argparse.Namespace) -> TenantsFile | None:
    """The tenants (None: anonymous) once the front-door arguments check out; a ValueError
    says what is wrong, in one line, before anything starts."""
    from kvroute.router.fleet.tenants import (
        hash_key,
        load_api_keys,
        load_tenants,
        tenants_from_api_keys,
    )
    from kvroute.router.routing.policies import POLICIES

    if args.policy not in POLICIES:
        raise ValueError(f"unknown policy {args.policy!r}; choose from {', '.join(POLICIES)}")
    metrics_key = front_door_metrics_key(args)  # read now: a missing file fails at once
    try:
        spec = None
        if args.tenants:
            spec = load_tenants(args.tenants)
        elif args.api_keys:
            spec = tenants_from_api_keys(load_api_keys(args.api_keys))
    except (OSError, ValueError) as exc:
        flag = "--tenants" if args.tenants else "--api-keys"
        raise ValueError(f"{flag}: {exc}") from None
    if spec is not None:
        taken = {k.lower() for t in spec.tenants for k in t.keys}
        if metrics_key and hash_key(metrics_key) in taken:
            raise ValueError("--metrics-key: it is also a tenant's key; give it one of its own")
        return spec
    if not is_loopback(args.host) and not args.allow_anonymous:
        raise ValueError(
            f"refusing to serve anonymously on {args.host}: give --tenants FILE, or "
            "--allow-anonymous to let anyone who can reach this address use the fleet"
        )
    return None


def front_door_metrics_key(args: argparse.Namespace) -> str | None:
    """The key that may read ``/metrics`` (``--metrics-key``, ``--metrics-key-file`` or
    ``$KVROUTE_METRICS_KEY``), or None; a ValueError says what is wrong."""
    from kvroute.router.fleet.tenants import resolve_metrics_key

    return resolve_metrics_key(
        getattr(args, "metrics_key", None), getattr(args, "metrics_key_file", None)
    )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def describe_tenants(spec: TenantsFile | None) -> str:
    if spec is None:
        return "anonymous: one tenant 'default', no API key needed"
    from kvroute.router.fleet.tenants import Limits

    limited = sum(t.limits != Limits() for t in spec.tenants)
    return (
        f"{len(spec.tenants)} tenant(s), {limited} with limits, {len(spec.admin_keys)} admin key(s)"
    )


def discover(timeout_s: float = 120.0) -> list[tuple[Any, Any]]:
    """(actor, info) of the replicas named in this driver's namespace that answer within
    ``timeout_s`` (every one, if all do); one still loading or failing is left to the
    front door's finder, which adds it once it answers. TimeoutError: none answered."""
    fleet = named_replicas()
    infos = answers({rid: a.info.remote() for rid, a in fleet.items()}, timeout_s)
    found = [(fleet[rid], info) for rid, info in infos.items() if info is not None]
    if fleet and not found:
        raise TimeoutError(f"no replica answered within {timeout_s:g} s")
    return found


def answers(refs: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Each key's Ray call result, or None where it failed or did not answer within
    ``timeout_s`` (a replica loading, restarting or dead), in ``refs``' order."""
    import ray

    if not refs:  # Ray refuses to wait for nothing
        return {}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    done = set(ready)
    out: dict[str, Any] = dict.fromkeys(refs)
    for key, ref in refs.items():
        if ref in done:
            with contextlib.suppress(Exception):  # failed: None
                out[key] = ray.get(ref)
    return out


def named_replicas() -> dict[str, Any]:
    """Replica id -> actor, for every replica named in this driver's namespace, in id order
    (the fleet's membership: ``kvroute scale`` starts and retires them)."""
    import ray

    names = [n for n in ray.util.list_named_actors() if n.startswith(REPLICA_ACTOR_PREFIX)]
    found = {n.removeprefix(REPLICA_ACTOR_PREFIX): ray.get_actor(n) for n in names}
    return {rid: found[rid] for rid in sorted(found, key=_order)}


def _order(rid: str) -> tuple[int, str]:
    """``r10`` after ``r9``: numbered ids by number, others after them by name."""
    m = re.fullmatch(r"r(\d+)", rid)
    return (int(m.group(1)), "") if m else (sys.maxsize, rid)


async def find_replicas() -> dict[str, Any]:
    """:func:`named_replicas`, off the event loop (Ray's calls block)."""
    return await asyncio.to_thread(named_replicas)


def build_app(
    args: argparse.Namespace, replicas: list[tuple[Any, Any]], spec: TenantsFile | None
) -> Any:
    """The front door over ``replicas`` and its FastAPI app."""
    from kvroute.router.api.agents.tools import ToolConfig
    from kvroute.router.api.app import create_app
    from kvroute.router.fleet.flow import DEFAULT_TOKENS
    from kvroute.router.fleet.tenants import Tenants, resolve_fleet_secret
    from kvroute.router.frontdoor import FrontDoor

    tokenizer = _tokenizer(args, replicas)

    def admission_for(n: int) -> tuple[int | None, int | None, int]:
        """Admission's limits for a fleet of ``n`` replicas (what was not given grows and
        shrinks with it)."""
        max_in_flight = args.max_in_flight or 128 * max(n, 1)
        per_tenant = args.max_in_flight_per_tenant
        if per_tenant is None and spec is not None and len(spec.tenants) > 1:
            per_tenant = max(1, max_in_flight // 2)  # a flood leaves the others half
        queue = args.admission_queue if args.admission_queue is not None else 8 * max_in_flight
        return max_in_flight, per_tenant, queue

    max_in_flight, per_tenant, queue = admission_for(len(replicas))
    if args.log_requests:
        _log_requests_to_stderr()
    shared = None
    if not fronts_backends(args):  # Ray's replicas: the fleet's one registry
        from kvroute.router.lora.shared import shared_registry

        # On a cluster it outlives this front door, as the replicas do (kvroute stop ends
        # both); on kvroute serve's own local Ray it lives as long as that Ray.
        shared = shared_registry(detached=bool(getattr(args, "address", None)))
    loras = _fleet_adapters(replicas, shared)
    door = FrontDoor(
        replicas,
        lora_adapters=loras.paths,
        lora_holders=loras.holders,
        lora_shared=shared,
        served_model=args.served_model_name,
        policy=args.policy,
        tokenizer=tokenizer,
        max_in_flight=max_in_flight,
        max_in_flight_per_tenant=per_tenant,
        admission_queue=queue,
        admission_timeout_s=args.admission_timeout,
        find_replicas=None if fronts_backends(args) else find_replicas,
        admission_for=admission_for,
        pd_split="always" if getattr(args, "pd_split", "") == "always" else "priced",
        pd_pair=getattr(args, "pd_split", "") == "pair",
        prefix_fetch=getattr(args, "prefix_fetch", False),
        flow_depth=getattr(args, "flow_depth", 0) or None,
        flow_tokens=getattr(args, "flow_tokens", None) or DEFAULT_TOKENS,
        flow_max_waiting=getattr(args, "max_waiting_per_priority", None),
    )
    tenants = Tenants(spec, resolve_fleet_secret(args.fleet_secret), front_door_metrics_key(args))
    tools = ToolConfig(getattr(args, "tool_call_parser", None),
                       getattr(args, "enable_auto_tool_choice", False))  # fmt: skip
    return create_app(
        door,
        tenants,
        args.served_model_name,
        max_body_bytes=args.max_body_bytes,
        body_timeout_s=args.body_timeout,
        send_timeout_s=args.send_timeout,
        public=not is_loopback(args.host),
        tools=tools,
        priority_header=getattr(args, "priority_header", None),
    )


def _tokenizer(args: argparse.Namespace, replicas: list[tuple[Any, Any]]) -> Any | None:
    """The front door's tokenizer: ``--tokenizer``'s folder, else the model's where the
    replicas' folder is not on this node; None: the front door reads the replicas' own."""
    folder = getattr(args, "tokenizer", None)
    if folder is not None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder)
    if not Path(replicas[0][1].model_path).is_dir():  # the replicas live on another node
        from transformers import AutoTokenizer

        from kvroute.replica.model.models import resolve_model

        return AutoTokenizer.from_pretrained(resolve_model(replicas[0][1].model))
    return None


def _log_requests_to_stderr() -> None:
    """``--log-requests``: the ``kvroute.requests`` log (a line per finished request) to
    stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    request_log = logging.getLogger("kvroute.requests")
    request_log.addHandler(handler)
    request_log.setLevel(logging.INFO)
    request_log.propagate = False


def _fleet_adapters(replicas: list[tuple[Any, Any]], shared: Any = None) -> FleetLoRAs:
    """The LoRA adapters the replicas hold (or, once a front door started, the ones the
    fleet's ``shared`` registry lists), every replica made to hold all of them, and which
    did (:func:`kvroute.router.lora.registry.prepare_fleet`); replicas without LoRA calls (``vllm
    serve`` backends) are left out. Raises FleetMismatchError on a name held twice."""
    import asyncio

    from kvroute.router.frontdoor import FleetMismatchError
    from kvroute.router.lora.registry import AdapterConflictError, prepare_fleet

    actors = {info.replica_id: a for a, info in replicas if hasattr(a, "list_loras")}
    try:
        return asyncio.run(prepare_fleet(actors, shared))
    except AdapterConflictError as exc:
        raise FleetMismatchError(str(exc)) from None


# On Ctrl-C, requests in flight get this long to finish; then their streams are cut.
DRAIN_S = 5.0


class _QuietCancel(logging.Filter):
    """uvicorn logs each request it cancels at shutdown (past the drain, or on a second
    Ctrl-C) as an ASGI exception with its full traceback, and the lifespan's cancellation
    too: expected events, said in one line of kvroute's own instead."""

    def __init__(self, say: Callable[[str], None]) -> None:
        super().__init__()
        self.say = say

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, asyncio.CancelledError):
            return False
        if isinstance(record.msg, str) and record.msg.startswith("Cancel %s running task"):
            self.say(f"cut {record.args[0] if record.args else 'the'} stream(s) still running")
            return False
        return True


def serve_app(
    app: Any,
    sock: socket.socket,
    ready: Callable[[], None] | None = None,
    head_timeout_s: float = 30.0,
    say: Callable[[str], None] = say,
) -> None:
    """uvicorn on ``sock`` (from :func:`listen_socket`).
    ``ready`` runs once the server accepts connections (what a "ready" line may promise);
    ``head_timeout_s``: a request head slower than this closes its connection. On Ctrl-C,
    requests in flight get :data:`DRAIN_S` to finish (a second Ctrl-C ends them at once)."""
    from .http_server import IdleQuietServer, uvicorn_config

    class Server(IdleQuietServer):
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            busy = len(self.server_state.tasks)
            if busy:
                say(f"stopping: {busy} request(s) in flight get {DRAIN_S:.0f} s to finish")
            await super().shutdown(sockets)

    server = Server(uvicorn_config(app, head_timeout_s, timeout_graceful_shutdown=DRAIN_S))

    def announce() -> None:
        while not server.started and not server.should_exit:
            time.sleep(0.05)
        if server.started and ready is not None:
            ready()

    threading.Thread(target=announce, daemon=True).start()
    quiet = _QuietCancel(say)
    log = logging.getLogger("uvicorn.error")
    log.addFilter(quiet)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it shut down on (as uvicorn.run)
        pass
    finally:
        log.removeFilter(quiet)


def fronts_backends(args: argparse.Namespace) -> bool:
    """Whether this front door fronts ``vllm serve`` processes (``--backend``,
    ``--prefill``, ``--decode``) rather than Ray's replicas."""
    return any(getattr(args, flag, None) for flag in ("backend", "prefill", "decode"))


def open_door(args: argparse.Namespace) -> tuple[Any, socket.socket] | None:
    """``kvroute router``'s flags checked, its tenants read and its socket bound (before
    Ray or any backend is reached): (tenants, socket), or None once it said why not."""
    from .http_server import listen_or_say
    from .serve_checks import check_front_door

    try:
        if why := check_front_door(args):
            raise ValueError(why)
        spec = front_door_tenants(args)
    except ValueError as exc:
        say(str(exc))
        return None
    sock = listen_or_say(args.host, args.port, args.reuse_port, say)
    return None if sock is None else (spec, sock)


def run(args: argparse.Namespace) -> int:
    if fronts_backends(args):
        return run_backends(args)
    import ray

    from kvroute.router.frontdoor import FleetMismatchError

    door = open_door(args)
    if door is None:
        return 2
    spec, sock = door
    port = sock.getsockname()[1]
    ray.init(address=args.address, namespace=args.namespace, logging_level="warning")
    try:
        replicas = discover()
        if not replicas:
            say(f"no replicas named {REPLICA_ACTOR_PREFIX}* in namespace {args.namespace!r}")
            return 2
        try:
            app = build_app(args, replicas, spec)
        except FleetMismatchError as exc:
            say(str(exc))
            return 2
        message = (
            f"ready on http://{args.host}:{port}/v1 ({len(replicas)} replicas, "
            f"policy {args.policy}; {describe_tenants(spec)})"
        )
        serve_app(app, sock, lambda: say(message), args.body_timeout)
        return 0
    except KeyboardInterrupt:
        return 130
    finally:
        sock.close()
        ray.shutdown()


def describe_backends(args: argparse.Namespace) -> list[tuple[Any, Any]]:
    """(control, info) of every ``--backend``, once each answers; a ValueError says, in
    one line, which cannot be fronted and why."""
    from kvroute.router.backends.control import (
        VLLM_DEFAULT_SEED,
        BackendError,
        BackendSpec,
        describe,
    )

    prefill, decode = getattr(args, "prefill", []), getattr(args, "decode", [])
    if bool(prefill) != bool(decode):
        raise ValueError("--prefill and --decode go together: a P/D pair needs both pools")
    specs = [BackendSpec.parse(text) for text in args.backend]
    specs += [BackendSpec.parse(text, "prefill") for text in prefill]
    specs += [BackendSpec.parse(text, "decode") for text in decode]
    urls = [s.url for s in specs]
    if len(set(urls)) != len(urls):
        raise ValueError("--backend/--prefill/--decode: the same URL is given twice")
    out = []
    for s in specs:
        try:
            out.append(
                describe(
                    s,
                    topic=args.events_topic,
                    hash_seed=args.hash_seed or VLLM_DEFAULT_SEED,
                    block_size=args.block_size,
                    wait_s=args.backend_wait,
                    say=say,
                )
            )
        except BackendError as exc:
            raise ValueError(str(exc)) from None
    if args.tokenizer is None and not Path(out[0][1].model_path).is_dir():
        raise ValueError(
            f"the backends' weights folder {out[0][1].model_path!r} is not on this host: "
            "give --tokenizer FOLDER (the model's tokenizer files)"
        )
    return out


def run_backends(args: argparse.Namespace) -> int:
    """``kvroute router --backend ...``: the front door over ``vllm serve`` processes."""
    door = open_door(args)
    if door is None:
        return 2
    spec, sock = door
    with sock:
        return _serve_backends(args, spec, sock)


def _serve_backends(args: argparse.Namespace, spec: Any, sock: socket.socket) -> int:
    from kvroute.router.frontdoor import FleetMismatchError

    try:
        backends = describe_backends(args)
        app = build_app(args, backends, spec)
    except (ValueError, FleetMismatchError) as exc:
        say(str(exc))
        return 2
    info = backends[0][1]
    roles = [i.role for _, i in backends]
    pd = ""
    if "prefill" in roles:
        pd = (
            f", P/D: {roles.count('prefill')} prefill + {roles.count('decode')} decode "
            f"(kv_transfer_params, --pd-split {args.pd_split})"
        )
    port = sock.getsockname()[1]
    message = (
        f"ready on http://{args.host}:{port}/v1 ({len(backends)} vllm serve backend(s) "
        f"of {info.model!r}, {info.block_size}-token blocks, policy {args.policy}{pd}; "
        f"{describe_tenants(spec)})"
    )
    try:
        serve_app(app, sock, lambda: say(message), args.body_timeout)
    except KeyboardInterrupt:
        return 130
    return 0
