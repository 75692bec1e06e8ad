"""A served fleet for HTTP tests: replica actors on a local Ray behind the real front door
under uvicorn, on a free loopback port."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import ray
import uvicorn

from kvroute.deploy.http_server import uvicorn_config
from kvroute.replica.serve.actor import start_replica
from kvroute.router.api.app import create_app
from kvroute.router.fleet.tenants import Tenants, tenants_from_api_keys
from kvroute.router.frontdoor import FrontDoor

from ..prom import METRICS_KEY
from ..ray_session import local_ray
from ..waiting import wait_for

MODEL = "tiny"
# What must never reach a client: remote tracebacks, Ray's names, pids, addresses, colours.
LEAKS = ("Traceback", "ray::", "\x1b", "pid=", 'File "', "127.0.0.1", "Actor", "RayTaskError")
KEYS = {"key-a": "alpha", "key-b": "beta"}


@dataclass
class Served:
    url: str
    door: FrontDoor
    actors: dict[str, Any]
    server: uvicorn.Server | None = None


@contextlib.contextmanager
def serve(
    actors: Sequence[Any],
    infos: Sequence[Any] | None = None,
    head_timeout_s: float = 30.0,
    idle_timeout_s: float | None = None,
    door_kw: dict[str, Any] | None = None,
    **app_kw: Any,
) -> Iterator[Served]:
    """Serves ``actors`` (already created, Ray running) until the block ends. ``infos``:
    their ReplicaInfo as the front door should see it (default: what they report);
    ``door_kw``: more of the FrontDoor's arguments (its LoRA adapters)."""
    if infos is None:
        infos = ray.get([a.info.remote() for a in actors], timeout=120)
    kw: dict[str, Any] = {"monitor_interval_s": 0.5, **(door_kw or {})}
    door = FrontDoor(list(zip(actors, infos, strict=True)), **kw)
    tenants = Tenants(tenants_from_api_keys(KEYS), "test-secret", METRICS_KEY)
    app = create_app(door, tenants, **app_kw)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # As kvroute serve configures it (head deadlines, keep-alive past a load balancer's).
    idle = {} if idle_timeout_s is None else {"idle_timeout_s": idle_timeout_s}
    config = uvicorn_config(app, head_timeout_s, host="127.0.0.1", port=port, **idle)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 30, "uvicorn started")
    try:
        ids = [i.replica_id for i in infos]
        by_id = dict(zip(ids, actors, strict=True))
        yield Served(f"http://127.0.0.1:{port}", door, by_id, server)
    finally:
        server.should_exit = True
        thread.join(10)


@contextlib.contextmanager
def serve_sim(prefix: str, n: int, config: dict[str, Any], **actor_kw: Any) -> Iterator[Served]:
    """A local Ray, ``n`` cost-model replicas (``config``'s ``sim:`` model; no CPU reserved:
    they sleep) named ``<prefix><i>``, served until the block ends."""
    with local_ray() as started:
        actors = [start_replica(f"{prefix}{i}", config, num_cpus=0, **actor_kw) for i in range(n)]
        started.extend(actors)
        with serve(actors) as s:
            yield s


@contextlib.contextmanager
def serve_model(prefix: str, n: int, config: dict[str, Any], **actor_kw: Any) -> Iterator[Served]:
    """A local Ray, ``n`` replicas of a real model (``config``'s; half a CPU and one torch
    thread each) named ``<prefix><i>``, served until the block ends."""
    with local_ray() as started:
        actors = [
            start_replica(f"{prefix}{i}", config, num_cpus=0.5, torch_threads=1, **actor_kw)
            for i in range(n)
        ]
        started.extend(actors)
        with serve(actors) as s:
            yield s


def assert_clean_error(r: httpx.Response, status: int) -> dict[str, Any]:
    """The status, the OpenAI shape, one line, the request id, and nothing of the insides."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert {"message", "type", "param", "code", "request_id"} <= set(err)
    assert err["request_id"] == r.headers["x-request-id"]
    assert err["message"] and "\n" not in err["message"] and len(err["message"]) <= 300
    for leak in LEAKS:
        assert leak not in r.text, (leak, r.text)
    return err
