"""``kvroute scale --prefill-replicas/--decode-replicas`` on a running P/D fleet: real local
Ray, real replica actors of the built-in ``tiny`` model, each with its ``role``.

What it proves: growing the decode pool adds a twin of a decode replica (its ``info()``
says ``decode``) and leaves the prefill pool as it was; shrinking the prefill pool retires
prefill replicas only; what would break the fleet (a pool shrunk to 0 beside a non-empty
one, a pool with nothing to copy, negative sizes) is refused in one line, exit status 2,
before anything starts or stops.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from kvroute.deploy.router import REPLICA_ACTOR_PREFIX, named_replicas
from kvroute.deploy.scale_roles import check_pools, refusal
from kvroute.replica.serve.actor import start_replica

from ..ray_session import local_ray
from ..serve_process import KVROUTE
from ..waiting import wait_for

pytestmark = pytest.mark.slow

CONFIG = {"model": "tiny", "block_size": 16, "num_blocks": 64}
ROLES = {"r0": "prefill", "r1": "prefill", "r2": "decode"}


@pytest.fixture(scope="module")
def fleet() -> Iterator[list[Any]]:
    """Two prefill replicas and one decode replica, named as ``kvroute serve`` names them."""
    with local_ray() as started:
        for rid, role in ROLES.items():
            started.append(
                start_replica(
                    rid,
                    {**CONFIG, "role": role},
                    num_cpus=0.25,
                    torch_threads=1,
                    name=REPLICA_ACTOR_PREFIX + rid,
                )
            )
        ray.get([a.info.remote() for a in started], timeout=300)
        try:
            yield started
        finally:  # the ones kvroute scale started (detached) are killed too
            started.extend(named_replicas().values())


def roles() -> dict[str, tuple[str, bool]]:
    """Each named replica's (role, draining), asked now."""
    fleet = named_replicas()
    infos = ray.get([a.info.remote() for a in fleet.values()], timeout=60)
    return {rid: (info.role, info.draining) for rid, info in zip(fleet, infos, strict=True)}


def scale(*args: str) -> tuple[int, list[str]]:
    """``kvroute scale ARGS`` on this test's Ray, as a user runs it: (status, its lines)."""
    ctx = ray.get_runtime_context()
    cmd = [*KVROUTE, "scale", "--address", ctx.gcs_address, "--namespace", ctx.namespace,
           "--drain-quiet", "0.5", *args]  # fmt: skip
    done = subprocess.run(cmd, env=os.environ, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("kvroute scale:")]
    return done.returncode, lines


@pytest.mark.parametrize(
    "args, says",
    [
        (["--prefill-replicas", "-1"], "--prefill-replicas must be >= 0"),
        (["--decode-replicas", "-2", "--prefill-replicas", "1"], "--decode-replicas must be >= 0"),
        (["--replicas", "-1", "--decode-replicas", "1"], "--replicas must be >= 0"),
        (["--prefill-replicas", "0", "--decode-replicas", "2"], "needs both pools or neither"),
        (["--prefill-replicas", "0", "--decode-replicas", "0", "--replicas", "0"], "kvroute stop"),
        ([], "give the new size"),
    ],
)
def test_flags_refused_before_ray(args: list[str], says: str) -> None:
    """No Ray is reached (--address points nowhere): one line, status 2."""
    cmd = [*KVROUTE, "scale", "--address", "127.0.0.1:1", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and says in done.stderr, done.stderr


def test_refusals_that_need_the_fleet_read() -> None:
    """:func:`_refusal` on pools as read: role -> live (not draining) and all replicas."""
    pd = {"prefill": ["r0"], "decode": ["r1"], "both": []}
    unified = {"prefill": [], "decode": [], "both": ["r0", "r1"]}
    why = refusal({"prefill": 2}, {"prefill": 2, "decode": 0, "both": 2}, unified, unified)
    assert why and "no running prefill replica to copy" in why and "no P/D roles" in why
    why = refusal({"both": 1}, {"prefill": 1, "decode": 1, "both": 1}, pd, pd)
    assert why and "--replicas 1: no running whole-request replica" in why
    why = refusal({"decode": 0}, {"prefill": 1, "decode": 0, "both": 0}, pd, pd)
    assert why and "--decode-replicas 0 would leave 1 prefill replica(s)" in why
    both0 = {"prefill": 0, "decode": 0, "both": 0}
    assert "no replica" in (refusal({"prefill": 0, "decode": 0}, both0, pd, pd) or "")
    # P/D ended on purpose: both pools to 0 while whole-request replicas serve on
    mixed = {**pd, "both": ["r2"]}
    assert refusal({"prefill": 0, "decode": 0}, {**both0, "both": 1}, mixed, mixed) is None
    assert check_pools({"prefill": 3, "decode": 1}) is None


def test_refusals_on_a_running_fleet_touch_nothing(fleet: list[Any]) -> None:
    before = roles()
    for args, says in [
        (["--prefill-replicas", "0"], "--prefill-replicas 0 would leave 1 decode replica(s)"),
        (["--decode-replicas", "0"], "--decode-replicas 0 would leave 2 prefill replica(s)"),
        (["--replicas", "1"], "no running whole-request replica to copy"),
    ]:
        code, lines = scale(*args)
        assert code == 2 and len(lines) == 1 and says in lines[0], (args, lines)
    assert roles() == before


def test_growing_the_decode_pool_copies_a_decode_replica(fleet: list[Any]) -> None:
    code, lines = scale("--decode-replicas", "2")
    assert code == 0, lines
    assert any("replica r3 ready" in ln for ln in lines), lines
    assert roles() == {
        **{rid: (role, False) for rid, role in ROLES.items()},
        "r3": ("decode", False),
    }
    spec = ray.get(named_replicas()["r3"].launch_spec.remote(), timeout=30)
    assert spec.engine_config["role"] == "decode"


def test_shrinking_the_prefill_pool_retires_prefill_replicas_only(fleet: list[Any]) -> None:
    if "r3" not in named_replicas():  # run alone: grow the decode pool first
        assert scale("--decode-replicas", "2")[0] == 0
    code, lines = scale("--prefill-replicas", "1")
    assert code == 0, lines
    assert any("replica r1 stopped" in ln for ln in lines), lines
    assert any("1 prefill replica(s): r0" in ln for ln in lines), lines
    wait_for(lambda: "r1" not in named_replicas(), 15, "r1 leaves the named actors")
    assert roles() == {"r0": ("prefill", False), "r2": ("decode", False), "r3": ("decode", False)}
