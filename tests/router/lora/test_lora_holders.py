"""A LoRA adapter that some replicas lack (issue 37, peers' aibrix#1095), with real parts:
a local Ray, two replica actors of ``tiny``, the front door under uvicorn, httpx.

The fleet: ``h0`` serves ``big`` (rank 16) and ``late`` (rank 8) from its start;
``h1`` is started with ``max_lora_rank=8``, so it refuses ``big`` for good, and
``late``'s folder is away while the fleet is prepared, so ``h1`` fails to take it then.

What must hold: the registry knows who took what; every request for ``big`` runs on
``h0`` and none fails, while base-model requests still spread over both; the periodic
sync gives ``h1`` ``late`` once its folder is back, and routes it there; with no live
holder, a request for the adapter gets a 503 that names it, and base-model requests
still run.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import ray

from kvroute.replica.serve.actor import start_replica
from kvroute.router.api.responses import REPLICA_HEADER
from kvroute.router.lora.registry import FleetLoRAs, prepare_fleet
from kvroute.router.routing.policies import make_policy

from ...lora_adapters import SHAPES, make_adapter
from ...prom import METRICS_KEY
from ...ray_session import local_ray
from ...waiting import wait_for
from ..served import Served, assert_clean_error, serve

CONFIG = {"model": "tiny", "block_size": 16, "num_blocks": 128, "enable_lora": True,
          "max_loras": 2}  # fmt: skip
KEY = {"authorization": "Bearer key-a"}  # every adapter (tests/router/served.py's KEYS)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, FleetLoRAs]]:
    root = tmp_path_factory.mktemp("holders")
    big = make_adapter(root / "big", 11, **SHAPES[1])  # rank 16
    late = make_adapter(root / "late", 12, **SHAPES[0])  # rank 8
    with local_ray() as started:
        h0 = start_replica("h0", {**CONFIG, "lora_modules": {"big": big, "late": late}},
                           num_cpus=0.5, torch_threads=1)  # fmt: skip
        h1 = start_replica("h1", {**CONFIG, "max_lora_rank": 8}, num_cpus=0.5, torch_threads=1)
        started.extend([h0, h1])
        ray.get([h0.info.remote(), h1.info.remote()], timeout=120)
        os.rename(late, late + ".away")  # a mount that hiccups while h1 is synced
        try:
            held = asyncio.run(prepare_fleet({"h0": h0, "h1": h1}))
        finally:
            os.rename(late + ".away", late)
        door_kw = {"lora_adapters": held.paths, "lora_holders": held.holders,
                   "lora_resync_s": 1.0}  # fmt: skip
        with serve([h0, h1], door_kw=door_kw) as served:
            yield served, held


def complete(served: Served, model: str, i: int) -> httpx.Response:
    body = {"model": model, "prompt": f"{i} request number {i}, under {model}.",
            "max_tokens": 2, "temperature": 0}  # fmt: skip
    return httpx.post(served.url + "/v1/completions", json=body, headers=KEY, timeout=120)


def spread(served: Served, model: str, n: int) -> list[str]:
    """``n`` concurrent requests (distinct prompts): where each ran; each must succeed."""
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: complete(served, model, i), range(n)))
    for r in answers:
        assert r.status_code == 200, r.text
    return [r.headers[REPLICA_HEADER] for r in answers]


def holders_gauge(served: Served) -> dict[str, float]:
    auth = {"authorization": f"Bearer {METRICS_KEY}"}
    text = httpx.get(served.url + "/metrics", headers=auth, timeout=30).text
    found = re.findall(r'^kvroute:lora_adapter_replicas\{adapter="([^"]+)"\} (\S+)$', text, re.M)
    return {name: float(n) for name, n in found}


def test_prepare_records_which_replicas_took_each_adapter(fleet) -> None:  # type: ignore[no-untyped-def]
    _, held = fleet
    assert set(held.paths) == {"big", "late"}
    assert held.holders == {"big": {"h0"}, "late": {"h0"}}  # h1 refused both


@pytest.mark.parametrize("policy", ["round_robin", "kv", "lora_affinity", "kv:lora_blind"])
def test_an_adapter_runs_only_where_it_is_held_and_the_base_model_everywhere(  # type: ignore[no-untyped-def]
    fleet, policy: str
) -> None:
    """Under every kind of policy (round_robin would alternate without the holders'
    filter, kv prices the adapter, lora_affinity scores residency, lora_blind neither)."""
    served, _ = fleet
    door = served.door
    fl = door.fleet
    door.policy = make_policy(policy, index=fl.index, block_size=fl.hasher.block_size,
                              load=fl.load)  # fmt: skip
    try:
        assert fl.routable() == ["h0", "h1"]  # h1 is routed (base model)
        assert set(spread(served, "big", 12)) == {"h0"}  # none reached h1, none failed
        on = spread(served, "tiny", 12)
        if policy == "round_robin":  # the others may keep a short burst on one replica
            assert set(on) == {"h0", "h1"}
    finally:
        door.policy = make_policy("kv", index=fl.index, block_size=fl.hasher.block_size,
                                  load=fl.load)  # fmt: skip


def test_the_periodic_sync_gives_a_replica_what_it_lacked(fleet) -> None:  # type: ignore[no-untyped-def]
    served, _ = fleet
    door = served.door
    wait_for(lambda: door.loras.holders("late") == {"h0", "h1"}, 30, "h1 holds late")
    # big is retried on every pass, and refused every time (its rank is beyond h1's)
    wait_for(lambda: door.errors["lora_sync_failed"] >= 2, 30, "big retried on h1")
    assert door.loras.holders("big") == {"h0"}
    assert "late" in ray.get(served.actors["h1"].list_loras.remote())
    assert holders_gauge(served) == {"big": 1.0, "late": 2.0}
    door.fleet.cordon("h0")  # late's only way now is h1, where it was missing at start
    try:
        assert set(spread(served, "late", 4)) == {"h1"}
    finally:
        door.fleet.cordon("h0", False)


def test_an_adapter_without_a_live_holder_gets_a_503_naming_it(fleet) -> None:  # type: ignore[no-untyped-def]
    served, _ = fleet
    door = served.door
    door.fleet.cordon("h0")  # big's only holder
    try:
        r = complete(served, "big", 0)
        err = assert_clean_error(r, 503)
        assert "`big`" in err["message"]
        assert (err["type"], err["param"], err["code"]) == (
            "service_unavailable", "model", "lora_adapter_unavailable"
        )  # fmt: skip
        assert r.headers["retry-after"] == "1"
        assert set(spread(served, "tiny", 3)) == {"h1"}  # the base model runs on
    finally:
        door.fleet.cordon("h0", False)
    assert set(spread(served, "big", 2)) == {"h0"}  # back once its holder is


def test_an_unload_forgets_the_holders_and_a_load_records_them(fleet, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    served, _ = fleet
    door = served.door
    path = make_adapter(tmp_path / "extra", 13, **SHAPES[4])  # rank 8: both take it

    async def load_then_unload() -> tuple[frozenset[str], frozenset[str]]:
        await door.load_lora("extra", path)
        loaded = door.loras.holders("extra")
        await door.unload_lora("extra")
        return loaded, door.loras.holders("extra")

    assert door._resync is not None  # the periodic sync: a task on the server's loop
    loop = door._resync.get_loop()
    loaded, unloaded = asyncio.run_coroutine_threadsafe(load_then_unload(), loop).result(120)
    assert loaded == {"h0", "h1"} and unloaded == frozenset()
