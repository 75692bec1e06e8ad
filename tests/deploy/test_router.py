"""Several front doors over one fleet: ``kvroute router`` processes beside ``kvroute serve``.

What must hold: every front door follows every replica's events and load (not only its own
requests), so a prefix cached through one front door draws the same prefix to the same
replica through another; front doors share one port; stopping ``serve`` stops them all.
Cost-model replicas (``sim:h100-8b``) keep it light: no weights, real caches and events.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest
import ray

from kvroute.deploy.router import RAY_NAMESPACE, REPLICA_ACTOR_PREFIX
from kvroute.replica.serve.actor import start_replica

from ..ray_session import shutdown
from ..waiting import wait_for

KVROUTE = [sys.executable, "-m", "kvroute.deploy.cli"]
SIM = {"model": "sim:h100-8b", "block_size": 16, "time_scale": 0.05}
PREFIX = [(11 * i + 5) % 128_000 for i in range(640)]  # 40 blocks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_router(address: str, port: int, *extra: str) -> subprocess.Popen[str]:
    args = ["router", "--address", address, "--port", str(port), *extra]
    proc = subprocess.Popen([*KVROUTE, *args], stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:
        if "ready on" in line:
            return proc
    raise AssertionError(f"router did not start (exit {proc.wait()})")


def stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def complete(port: int, prompt: list[int]) -> httpx.Response:
    body = {"model": "sim:h100-8b", "prompt": prompt, "max_tokens": 4}
    return httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)


@pytest.fixture(scope="module")
def fleet() -> Iterator[str]:
    """Four named cost-model replicas on a local Ray; yields the cluster's address."""
    shutdown()  # the run's shared local Ray: this module needs a Ray of its own
    ctx = ray.init(address="local", num_cpus=1, namespace=RAY_NAMESPACE, include_dashboard=False,
                   logging_level="warning")  # fmt: skip
    try:
        actors = [
            start_replica(f"r{i}", SIM, num_cpus=0, name=f"{REPLICA_ACTOR_PREFIX}r{i}")
            for i in range(4)
        ]
        ray.get([a.info.remote() for a in actors], timeout=120)
        yield ctx.address_info["gcs_address"]
    finally:
        ray.shutdown()


def test_a_prefix_cached_through_one_router_is_found_through_another(fleet: str) -> None:
    a_port, b_port = free_port(), free_port()
    a = start_router(fleet, a_port)
    b = start_router(fleet, b_port)
    try:
        first = complete(a_port, [*PREFIX, 1, 2, 3])
        assert first.status_code == 200, first.text
        holder = first.headers["x-kvroute-replica"]
        assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

        def index_blocks(port: int) -> float:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
            line = next(x for x in text.splitlines() if x.startswith(
                f'kvroute:index_blocks{{replica="{holder}"}}'))  # fmt: skip
            return float(line.split()[1])

        # B never saw the request; it learns of the blocks from the holder's event stream.
        wait_for(lambda: index_blocks(b_port) >= 40, 30, "router B indexed the holder's blocks")
        for i in range(3):
            again = complete(b_port, [*PREFIX, 7, 8, 9 + i])
            assert again.status_code == 200, again.text
            assert again.headers["x-kvroute-replica"] == holder
            assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 624
    finally:
        stop(a)
        stop(b)


def test_routers_share_one_port(fleet: str) -> None:
    port = free_port()
    routers = [start_router(fleet, port, "--reuse-port") for _ in range(2)]
    try:
        replies = [complete(port, [i % 50, 1 + i % 7, 2]) for i in range(12)]
        assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
        assert all(r.json()["usage"]["completion_tokens"] == 4 for r in replies)
    finally:
        for r in routers:
            stop(r)


def test_router_without_replicas_says_so(fleet: str) -> None:
    """A namespace with no replicas in it: exit 2 and a line that says why."""
    args = ["router", "--address", fleet, "--namespace", "empty"]
    out = subprocess.run([*KVROUTE, *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "no replicas named replica-*" in out.stderr, out.stderr


def test_serve_with_two_routers_then_ctrl_c() -> None:
    """``kvroute serve --routers 2``: both front doors answer on one port; Ctrl-C ends all."""
    port = free_port()
    args = ["serve", "--model", "sim:h100-8b", "--replicas", "2", "--routers", "2"]
    args += ["--port", str(port), "--time-scale", "0.05", "--block-size", "16"]
    proc = subprocess.Popen([*KVROUTE, *args], stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    try:
        lines: list[str] = []
        for line in proc.stderr:
            lines.append(line)
            if "ready: model" in line:
                break
        assert "2 front doors" in lines[-1], "".join(lines)
        replies = [complete(port, [3, 4, 5, i]) for i in range(10)]
        assert all(r.status_code == 200 for r in replies)
        proc.send_signal(signal.SIGINT)
        rest = proc.stderr.read()
        assert proc.wait(timeout=60) == 0, rest
        with pytest.raises(httpx.ConnectError):  # no front door left behind
            complete(port, [1])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
