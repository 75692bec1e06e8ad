"""``kvroute scale`` on a running ``kvroute serve --routers 2`` with a LoRA adapter, as a user
runs it from another shell: real Ray, real replica actors, both front doors over HTTP.

What it proves: a replica started by ``kvroute scale --replicas 2`` is a twin of the running
one, joins both front doors (each lists it and counts it among the adapter's holders:
a scaled-up replica is given the fleet's adapters before it is routed to), and serves
requests, the adapter's included. ``kvroute scale --replicas 1`` while streams run on
both replicas lets the retired replica's streams run to their last token before it is
stopped (none fails, none is cut), then both front doors drop it, and the fleet serves on.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from ..lora_adapters import SHAPES, make_adapter
from ..ray_session import shutdown
from ..serve_process import KVROUTE, kvroute_serve
from ..waiting import poll, wait_for
from .streaming import Stream, metric, read_stream

pytestmark = pytest.mark.slow

FRESH = 16  # new connections per check: both front doors answer some (1 in 2**15 not)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    shutdown()  # kvroute serve starts a Ray of its own: none of this process's may linger
    root = tmp_path_factory.mktemp("scale")
    ad0 = make_adapter(root / "ad0", 7, **SHAPES[1])
    log: list[str] = []
    args = ["--model", "tiny", "--replicas", "1", "--routers", "2", "--lora-modules",
            f"ad0={ad0}", "--fleet-secret", "scale-test"]  # fmt: skip
    with kvroute_serve(args, log=log) as url:
        wait_for(lambda: any("kvroute scale" in line for line in log), 20, "the scale hint")
        hint = next(line for line in log if "kvroute scale" in line)
        address = re.search(r"--address (\S+)", hint)
        assert address is not None, hint
        yield {"url": url, "address": address.group(1), "log": log}


def scale(served: dict[str, Any], n: int) -> str:
    """``kvroute scale --replicas n`` as printed by kvroute serve; its output."""
    env = {**os.environ, "RAY_AUTH_MODE": "token"}  # as the hint says for serve's own Ray
    cmd = [*KVROUTE, "scale", "--address", served["address"], "--replicas", str(n)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return done.stderr


def every_door(url: str, check: Any) -> bool:
    """``check(client)`` holds on ``FRESH`` new connections in a row (no keep-alive)."""
    for _ in range(FRESH):
        with httpx.Client(base_url=url, timeout=60, headers={"connection": "close"}) as c:
            if not check(c):
                return False
    return True


def replicas(c: httpx.Client) -> list[str]:
    return sorted(c.get("/health").json()["replicas"])


def holders(c: httpx.Client) -> float:
    return metric(c, "kvroute:lora_adapter_replicas", adapter="ad0")


def fleet_view(c: httpx.Client) -> dict[str, dict[str, Any]]:
    """/fleet's replicas by id (open to anyone on a loopback server without keys)."""
    return {r["replica_id"]: r for r in c.get("/fleet").json()["replicas"]}


# A driver of its own on the fleet's Ray (serve's, with its token): drains replica ARGV[2]
# as kvroute scale does (its running requests go on, front doors send it nothing new),
# says so, and takes it back (undrain) once its stdin closes.
AROUND = """
import sys, ray
from kvroute.deploy.router import named_replicas
ray.init(address=sys.argv[1], namespace="kvroute", logging_level="error")
replica = named_replicas()[sys.argv[2]]
ray.get(replica.drain.remote(), timeout=60)
print("drained", flush=True)
sys.stdin.read()
ray.get(replica.undrain.remote(), timeout=60)
print("taken back", flush=True)
"""


@contextlib.contextmanager
def routed_around(served: dict[str, Any], rid: str) -> Iterator[None]:
    """In the block every front door routes around replica ``rid`` (it drains), so a new
    request goes to another replica whatever the policy would have chosen; after it, every
    front door routes to ``rid`` again."""
    url = served["url"]
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    cmd = [sys.executable, "-c", AROUND, served["address"], rid]
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "drained", f"{rid} was not drained"
        wait_for(lambda: every_door(url, lambda c: fleet_view(c)[rid]["draining"]), 30,
                 f"every front door sees {rid} draining")  # fmt: skip
        yield
    finally:
        out, err = proc.communicate(timeout=120)  # its stdin closed: rid is taken back
    assert proc.returncode == 0 and "taken back" in out, err
    wait_for(lambda: every_door(url, lambda c: not fleet_view(c)[rid]["cordoned"]), 30,
             f"every front door routes to {rid} again")  # fmt: skip


def test_a_new_replica_joins_every_front_door_with_the_adapters(served: dict[str, Any]) -> None:
    url = served["url"]
    assert every_door(url, lambda c: replicas(c) == ["r0"])
    t0 = time.monotonic()
    out = scale(served, 2)
    t_ready = time.monotonic() - t0
    assert "replica r1 ready" in out, out
    wait_for(lambda: every_door(url, lambda c: replicas(c) == ["r0", "r1"]), 30,
             "both front doors list r1")  # fmt: skip
    print(f"\nscale up: kvroute scale returned after {t_ready:.1f} s (r1 loaded), both "
          f"front doors list r1 {time.monotonic() - t0:.1f} s after the command")  # fmt: skip
    wait_for(lambda: every_door(url, lambda c: holders(c) == 2), 60,
             "both front doors count r1 among ad0's holders")  # fmt: skip
    # A burst under the adapter, which only r1 can take: r0 drains meanwhile. (Left to the
    # policy, the burst may all go to r0: neither replica holds ad0 in a slot before its
    # first request there, and once placed, the adapter's load elsewhere is priced above
    # the tiny model's extra decode. Which replica gets the first is a seeded coin.)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    served_by: list[str] = []

    def one(i: int) -> None:
        raw = client.completions.with_raw_response.create(
            model="ad0", prompt=f"burst {i} " + "x " * 30, max_tokens=200, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        if raw.parse().choices[0].finish_reason == "length":
            served_by.append(raw.headers["x-kvroute-replica"])

    with routed_around(served, "r0"):
        threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    assert served_by == ["r1"] * 12, f"ad0's requests, with r0 drained: {served_by}"


@pytest.mark.timeout(600)  # its streams run to their end: minutes on a loaded 2-core host
def test_a_retired_replica_finishes_its_streams_then_leaves(served: dict[str, Any]) -> None:
    url = served["url"]
    if every_door(url, lambda c: replicas(c) == ["r0"]):
        scale(served, 2)  # run alone: grow first
        wait_for(lambda: every_door(url, lambda c: replicas(c) == ["r0", "r1"]), 30, "r1")
    # Long enough to outlast r0's drain and return, and the scale's start and drain
    # settling time, on a busy host (the streams were up to 37% done at the drain); short
    # enough to end within the drain's timeout (300 s) on one (3000 tokens took 280 s).
    max_tokens = 2000
    streams = [Stream(f"Document {i}: " + " ".join(f"w{i}x{j}" for j in range(20)))
               for i in range(6)]  # fmt: skip
    threads = [threading.Thread(target=read_stream, args=(url, s, max_tokens), daemon=True)
               for s in streams]  # fmt: skip
    # The first three run on r1 for certain (r0 drains while they are routed), the others
    # where the policy sends them: left to it, all six may go to r0 (a coin decides).
    with routed_around(served, "r0"):
        for t in threads[:3]:
            t.start()
        assert poll(lambda: all(s.started.is_set() for s in streams[:3]), 120)
    for t in threads[3:]:
        t.start()
    assert poll(lambda: all(s.started.is_set() for s in streams), 120)
    on_r1 = [s for s in streams if s.replica == "r1" and s.finish is None]
    assert on_r1, f"no stream runs on r1: {[(s.replica, s.chunks) for s in streams]}"
    at_drain = [s.chunks for s in on_r1]
    t0 = time.monotonic()
    out = scale(served, 1)
    t_stopped = time.monotonic() - t0
    assert "replica r1 stopped" in out, out
    for t in threads:
        t.join(300)
    print(f"\nscale down: {len(on_r1)} of {len(streams)} streams on r1, at {min(at_drain)}-"
          f"{max(at_drain)} chunks of {max_tokens} tokens when the drain began; r1 stopped "
          f"{t_stopped:.1f} s after the command")  # fmt: skip
    assert not any(t.is_alive() for t in threads), "a stream hangs"
    for s in streams:
        assert s.error is None, f"stream on {s.replica} failed: {s.error}"
        assert (s.tokens, s.finish) == (max_tokens, "length"), (s.replica, s.tokens, s.finish)
    # Each ran where it started: no front door moved a stream (a replica killed mid-stream
    # has its streams continued elsewhere, or failed), and none counts a replica failure.
    assert every_door(url, lambda c: metric(c, "kvroute:failovers_total") == 0)
    assert every_door(url, lambda c: metric(c, "kvroute:errors_total", kind="replica_failure") == 0)
    wait_for(lambda: every_door(url, lambda c: replicas(c) == ["r0"]), 30,
             "both front doors drop r1")  # fmt: skip
    log = "".join(served["log"])
    assert "replica r1 retired" in log
    assert "replica r1 failed" not in log  # a planned retirement is no failure
    r = httpx.post(url + "/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": "after", "max_tokens": 4})  # fmt: skip
    assert r.status_code == 200 and r.headers["x-kvroute-replica"] == "r0", r.text


def test_a_drain_left_behind_is_taken_back_by_the_next_scale(served: dict[str, Any]) -> None:
    """A ``kvroute scale`` stopped mid-drain (Ctrl-C) leaves its replica draining: the next
    ``kvroute scale`` up takes it back (no model to load), and front doors route to it."""
    url = served["url"]
    if every_door(url, lambda c: replicas(c) == ["r0"]):
        scale(served, 2)
    wait_for(lambda: every_door(url, lambda c: replicas(c) == ["r0", "r1"]), 30, "r1")
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    cmd = [*KVROUTE, "scale", "--address", served["address"], "--replicas", "1",
           "--drain-quiet", "120"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: every_door(url, lambda c: fleet_view(c)["r1"]["draining"]), 60,
                 "every front door sees r1 draining")  # fmt: skip
        assert proc.poll() is None, "the scale ended before it was interrupted"
    finally:
        proc.send_signal(signal.SIGINT)  # within the drain's quiet time: r1 is left draining
        proc.communicate(timeout=60)
    out = scale(served, 2)
    assert "replica r1 was left draining: taken back" in out, out
    assert "starting" not in out  # no twin was needed
    wait_for(lambda: every_door(url, lambda c: not fleet_view(c)["r1"]["cordoned"]), 30,
             "every front door routes to r1 again")  # fmt: skip


# A driver of its own on the fleet's Ray (serve's, with its token): the replicas' names,
# once they equal EXPECT (JSON, if given; killed actors leave the list within moments),
# and, given MORE, that many twins of r0 started detached first, as a scale killed with
# SIGKILL leaves them: on this 2-CPU Ray each waits for a CPU (or loads its model).
NAMES = """
import json, sys, time, ray
from kvroute.deploy.router import REPLICA_ACTOR_PREFIX, named_replicas
ray.init(address=sys.argv[1], namespace="kvroute", logging_level="error")
fleet = named_replicas()
if sys.argv[3] != "0":
    spec = ray.get(fleet["r0"].launch_spec.remote(), timeout=60)
    for i in range(int(sys.argv[3])):
        spec.start(f"r{90 + i}", f"{REPLICA_ACTOR_PREFIX}r{90 + i}", lifetime="detached")
expect, deadline = json.loads(sys.argv[2]), time.monotonic() + 15
while expect is not None and sorted(named_replicas()) != expect and time.monotonic() < deadline:
    time.sleep(0.2)
print(json.dumps(sorted(fleet) if sys.argv[3] != "0" else sorted(named_replicas())))
"""


def names(served: dict[str, Any], expect: list[str] | None = None, more: int = 0) -> list[str]:
    """The fleet's replica ids (see NAMES), read by a driver of its own."""
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    cmd = [sys.executable, "-c", NAMES, served["address"], json.dumps(expect), str(more)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def scale_cmd(served: dict[str, Any], *args: str) -> list[str]:
    return [*KVROUTE, "scale", "--address", served["address"], *args]


def run_scale(served: dict[str, Any], *args: str, timeout: float = 90) -> tuple[int, str, float]:
    """``kvroute scale ARGS``: (exit status, its lines, seconds); one still running after
    ``timeout`` is interrupted (Ctrl-C) and fails the test."""
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    t0 = time.monotonic()
    proc = subprocess.Popen(scale_cmd(served, *args), env=env, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        raise AssertionError(
            f"kvroute scale {args} still running after {timeout} s:\n{err}"
        ) from None
    return proc.returncode, err, time.monotonic() - t0


def said(err: str) -> list[str]:
    """kvroute scale's own lines (not Ray's)."""
    return [line for line in err.splitlines() if line.startswith("kvroute scale:")]


def test_a_size_the_cluster_cannot_hold_is_refused_before_anything_starts(
    served: dict[str, Any],
) -> None:
    """On serve's own 2-CPU Ray, 1000 replicas of 1 CPU each: one line, nothing started."""
    before = names(served)
    code, err, took = run_scale(served, "--replicas", "1000")
    print(f"\nrefused in {took:.1f} s: {said(err)}")
    assert code == 1 and len(said(err)) == 1, err
    assert f"{1000 - len(before)} more replica(s) need CPU 1 each" in err, err
    assert "room for" in err and "--wait-for-resources" in err and "Traceback" not in err
    assert names(served) == before


@pytest.mark.parametrize(
    "how", ["timeout", signal.SIGINT, signal.SIGTERM], ids=["timeout", "SIGINT", "SIGTERM"]
)
def test_a_grow_that_waits_for_resources_leaves_none_behind(
    served: dict[str, Any], how: Any
) -> None:
    """``--wait-for-resources``: at most a batch waits at once, and a grow that times out
    or is stopped (Ctrl-C, SIGTERM) stops every replica it started that is not ready."""
    before = names(served)
    args = ["--replicas", "1000", "--wait-for-resources"]
    if how == "timeout":
        code, err, _ = run_scale(served, *args, "--ready-timeout", "3")
    else:
        env = {**os.environ, "RAY_AUTH_MODE": "token"}
        proc = subprocess.Popen(
            scale_cmd(served, *args), env=env, stderr=subprocess.PIPE, text=True
        )
        assert proc.stderr is not None
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "loading the model" in line:
                break
        proc.send_signal(how)
        _, rest = proc.communicate(timeout=60)
        code, err = proc.returncode, "".join(lines) + rest
    print(f"\n{how}: {said(err)}")
    started = next(line for line in said(err) if "started" in line)
    assert len(started.split(",")) <= 8, started  # one batch, not 998 replicas
    assert code == (1 if how == "timeout" else 130), err
    assert "stopped 8 replica(s) not ready" in err, err
    assert names(served, before) == before


def test_replicas_left_waiting_are_stopped_at_once(served: dict[str, Any]) -> None:
    """Twins left pending (a scale killed with SIGKILL) are killed by the next scale down,
    not drained one after another (which took 30 s each for a replica that never answers)."""
    before = names(served, more=4)
    code, err, took = run_scale(served, "--replicas", str(len(before)))
    print(f"\n4 replicas left waiting stopped in {took:.1f} s (kvroute scale's whole run)")
    assert code == 0 and "stopped 4 replica(s) not running yet" in err, err
    assert took < 30, err  # was 4 x 30 s of drain timeouts, then their status polls
    assert names(served, before) == before
