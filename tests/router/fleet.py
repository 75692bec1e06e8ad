"""A served fleet for HTTP tests: replica actors on a local Ray behind the real front door
under uvicorn, on a free loopback port."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import ray
import uvicorn

from kvroute.router.frontdoor import FrontDoor
from kvroute.router.server import create_app
from kvroute.router.tenants import Tenants

from ..waiting import wait_for

MODEL = "tiny"
KEYS = {"key-a": "alpha", "key-b": "beta"}


@dataclass
class Served:
    url: str
    door: FrontDoor
    actors: dict[str, Any]


@contextlib.contextmanager
def serve(actors: Sequence[Any], **app_kw: Any) -> Iterator[Served]:
    """Serves ``actors`` (already created, Ray running) until the block ends."""
    infos = ray.get([a.info.remote() for a in actors], timeout=120)
    door = FrontDoor(list(zip(actors, infos, strict=True)), monitor_interval_s=0.5)
    app = create_app(door, Tenants(KEYS, "test-secret"), **app_kw)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 30, "uvicorn started")
    try:
        ids = [i.replica_id for i in infos]
        yield Served(f"http://127.0.0.1:{port}", door, dict(zip(ids, actors, strict=True)))
    finally:
        server.should_exit = True
        thread.join(10)
