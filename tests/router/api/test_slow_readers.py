"""Slow readers: a streaming client that stops reading is dropped once a send has waited
``send_timeout_s``, its request ends on the replica and its slot is released; another
tenant is served meanwhile. Cost-model replicas make a response long enough to fill the
socket's buffers in a few seconds.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
import ray

from kvroute.replica.serve.actor import start_replica

from ...ray_session import local_ray
from ...waiting import wait_for
from ..served import Served, serve

MODEL = "sim:h100-8b"
SIM = {"model": MODEL, "block_size": 16, "num_blocks": 4096, "time_scale": 0.01}
SEND_TIMEOUT = 2.0


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with local_ray() as started:
        actors = [start_replica("s0", SIM, num_cpus=0)]
        started.extend(actors)
        with serve(actors, send_timeout_s=SEND_TIMEOUT) as s:
            yield s


def test_a_client_that_stops_reading_is_dropped_and_frees_its_slot(served: Served) -> None:
    door = served.door
    host, port = served.url.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "prompt": [5] * 64, "max_tokens": 60_000,
                       "stream": True, "ignore_eos": True}).encode()  # fmt: skip
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: fills soon
    sock.connect((host, int(port)))
    t0 = time.perf_counter()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer key-a\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    try:
        wait_for(lambda: door.fleet.load.in_flight() == 1, 30, "the stream admitted")
        # Meanwhile another tenant is served.
        r = httpx.post(served.url + "/v1/completions", timeout=60,
                       headers={"Authorization": "Bearer key-b"},
                       json={"model": MODEL, "prompt": [7] * 32, "max_tokens": 4})  # fmt: skip
        assert r.status_code == 200
        wait_for(lambda: door.errors["slow_client"] == 1, 120, "the stuck reader dropped")
        dropped_after = time.perf_counter() - t0
        wait_for(lambda: door.fleet.load.in_flight() == 0, 30, "its slot released")
        # The server let go of the socket at once (aborted, its unsent data discarded),
        # though this client still reads nothing.
        assert served.server is not None
        connections = served.server.server_state.connections
        wait_for(lambda: not connections, 10, "the server's side of the connection closed")
        # On the replica the request ended too: nothing running, every block free again.
        stats = ray.get(served.actors["s0"].stats.remote())
        assert stats["num_running"] == stats["num_waiting"] == 0
        # Draining what reached this side ends at once (EOF, or a reset: data was dropped).
        sock.settimeout(30)
        received, chunk = 0, b""
        try:
            while chunk := sock.recv(1 << 16):
                received += len(chunk)
        except ConnectionResetError:
            pass
    finally:
        sock.close()
    assert received > 0 and b"[DONE]" not in chunk
    print(f"\nslow reader: dropped {dropped_after:.1f} s after sending (send timeout "
          f"{SEND_TIMEOUT} s); {received / 1024:.0f} KiB had reached its buffers")  # fmt: skip
