"""The fleet the HTTP tests serve, one per module: a local Ray, two replica actors of the tiny
model, and the FastAPI app under uvicorn in front of them."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import uvicorn

from kvroute.deploy.http_server import uvicorn_config
from kvroute.replica.serve.actor import start_replica
from kvroute.router.api.app import create_app
from kvroute.router.fleet.tenants import Tenants, tenants_from_api_keys
from kvroute.router.frontdoor import FrontDoor

from ...prom import METRICS_KEY
from ...ray_session import local_ray
from ...waiting import wait_for
from .http_fleet import CONFIG, KEYS


@pytest.fixture(scope="module")
def fleet() -> Iterator[dict[str, Any]]:
    with local_ray() as started:
        actors = [
            start_replica(f"r{i}", CONFIG, num_cpus=0.5, torch_threads=1, max_restarts=-1)
            for i in range(2)
        ]
        started.extend(actors)
        infos = ray.get([a.info.remote() for a in actors], timeout=120)
        door = FrontDoor(list(zip(actors, infos, strict=True)), monitor_interval_s=0.5)
        app = create_app(door, Tenants(tenants_from_api_keys(KEYS), "test-secret", METRICS_KEY))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = uvicorn.Server(uvicorn_config(app, host="127.0.0.1", port=port))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        wait_for(lambda: server.started, 30, "uvicorn started")
        url = f"http://127.0.0.1:{port}"
        actors_by_id = dict(zip(("r0", "r1"), actors, strict=True))
        yield {"url": url, "door": door, "actors": actors_by_id, "app": app}
        server.should_exit = True
        thread.join(10)
