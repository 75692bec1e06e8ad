"""The `kvroute` command, run as a user runs it."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx

from kvroute.events import BlockHasher, BlockStored, ZmqEventPublisher

KVROUTE = [sys.executable, "-m", "kvroute.deploy.cli"]


def test_serve_refuses_bad_arguments_before_starting_anything():
    for args, why in (
        (["--api-keys", "/nonexistent/keys"], "--api-keys"),
        (["--policy", "nope"], "unknown policy"),
        (["--replicas", "0"], "--replicas"),
    ):
        out = subprocess.run([*KVROUTE, "serve", *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and why in out.stderr, (args, out.stderr)


def test_serve_end_to_end_then_ctrl_c(tmp_path):
    """The real command: local Ray, one tiny replica, a request over HTTP, Ctrl-C."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "keys").write_text("sk-test:acme\n")
    args = ["serve", "--model", "tiny", "--replicas", "1", "--port", str(port)]
    args += ["--num-blocks", "64", "--api-keys", str(tmp_path / "keys"), "--log-requests"]
    proc = subprocess.Popen([*KVROUTE, *args], stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "ready: model 'tiny'" in line:
                break
        assert any(f"http://127.0.0.1:{port}/v1" in x for x in lines), "".join(lines)
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 3, "ignore_eos": True}
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json=body,
            headers={"Authorization": "Bearer sk-test"},
            timeout=60,
        )
        assert r.status_code == 200 and r.headers["x-kvroute-replica"] == "r0"
        assert r.json()["usage"]["completion_tokens"] == 3
        assert httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body).status_code == 401
        proc.send_signal(signal.SIGINT)
        rest = proc.stderr.read()
        assert proc.wait(timeout=60) == 0 and "stopped" in rest
        # --log-requests: one line for the routed request (the 401 never reached a replica)
        logged = [x for x in rest.splitlines() if " request " in x and "tenant=" in x]
        assert len(logged) == 1, rest
        assert "tenant=acme replica=r0 prompt=" in logged[0]
        assert "output=3 " in logged[0] and logged[0].endswith("status=200 length")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_hash_prints_the_same_hashes_as_the_library():
    tokens = list(range(40))
    out = subprocess.run(
        [*KVROUTE, "hash", ",".join(map(str, tokens)), "--seed", "s", "--cache-salt", "t"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    expected = BlockHasher(seed="s").hash_blocks(tokens, cache_salt="t")
    assert out.stdout.split() == [x for i, h in enumerate(expected) for x in (str(i), h.hex())]


def test_events_follows_a_live_publisher():
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", heartbeat_interval=None)
    try:
        for i in range(3):
            pub.publish([BlockStored([bytes([i + 1]) * 16], None, [0] * 4, 4, None, "GPU", None)])
        proc = subprocess.Popen(
            [*KVROUTE, "events", pub.endpoint, "--replay", pub.replay_endpoint, "--count", "3"],
            stdout=subprocess.PIPE,
            text=True,
        )
        time.sleep(0.5)
        for i in range(3, 5):
            pub.publish([BlockStored([bytes([i + 1]) * 16], None, [0] * 4, 4, None, "GPU", None)])
        out, _ = proc.communicate(timeout=60)
        lines = out.splitlines()
        assert proc.returncode == 0 and len(lines) == 3
        assert "source=snapshot stored=3" in lines[0]  # what it joined too late for, at once
        assert "source=live stored=1" in lines[1] and "source=live stored=1" in lines[2]
    finally:
        pub.close()
