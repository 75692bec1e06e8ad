"""Two front doors over the same replicas share one LoRA registry (issue 37), with real
parts: a local Ray, two replica actors of ``tiny``, the registry actor, two front doors
under uvicorn, httpx.

The bug this pins down: with a registry per front door, each one's periodic resync makes
every replica hold exactly *its* adapters, so an adapter loaded through A was removed from
every replica by B's next pass (and one unloaded through B came back by A's). With the
shared registry: B routes and lists what A loaded within a few polls, no resync removes
it, an unload through B is a 404 at A and stays unloaded, and a front door started later
takes the registry as it is.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray

from kvroute.replica.serve.actor import start_replica
from kvroute.router.api.responses import REPLICA_HEADER
from kvroute.router.lora.registry import prepare_fleet
from kvroute.router.lora.shared import DOOR_TTL_S, SharedLoRAs, shared_registry

from ...lora_adapters import SHAPES, make_adapter
from ...ray_session import local_ray
from ...waiting import wait_for
from ..served import Served, serve

CONFIG = {"model": "tiny", "block_size": 16, "num_blocks": 128, "enable_lora": True,
          "max_loras": 2}  # fmt: skip
KEY = {"authorization": "Bearer key-a"}  # every adapter (tests/router/served.py's KEYS)
RESYNC_S = 0.5  # both front doors' periodic pass: several run in each test's waits


class Fleet:
    """The replicas, the registry actor and two front doors, ``a`` and ``b``."""

    def __init__(self, actors: dict[str, Any], shared: Any, a: Served, b: Served) -> None:
        self.actors, self.shared, self.a, self.b = actors, shared, a, b

    def door_kw(self) -> dict[str, Any]:
        held = asyncio.run(prepare_fleet(self.actors, self.shared))
        return {"lora_adapters": held.paths, "lora_holders": held.holders,
                "lora_resync_s": RESYNC_S, "lora_shared": self.shared}  # fmt: skip

    def held(self) -> dict[str, set[str]]:
        """Replica id -> the adapters it holds now (asked of the replicas themselves)."""
        rids = list(self.actors)
        lists = ray.get([self.actors[r].list_loras.remote() for r in rids], timeout=60)
        return {rid: set(names) for rid, names in zip(rids, lists, strict=True)}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("shared")
    start = {"ad0": make_adapter(root / "ad0", 21, **SHAPES[0])}
    with local_ray() as started:
        actors = {
            f"s{i}": start_replica(f"s{i}", {**CONFIG, "lora_modules": start}, num_cpus=0.5,
                                   torch_threads=1)
            for i in range(2)
        }  # fmt: skip
        started.extend(actors.values())
        ray.get([a.info.remote() for a in actors.values()], timeout=120)
        shared = shared_registry(detached=False, name=f"test-lora-registry-{uuid.uuid4().hex}")
        started.append(shared)
        fl = Fleet(actors, shared, None, None)  # type: ignore[arg-type]
        replicas = list(actors.values())
        with (
            serve(replicas, door_kw=fl.door_kw()) as a,
            serve(replicas, door_kw=fl.door_kw()) as b,
        ):
            fl.a, fl.b = a, b
            yield fl


def on_loop(served: Served, coro: Coroutine[Any, Any, Any]) -> Any:
    """Runs ``coro`` on ``served``'s front door's loop (where its registry lives)."""
    task = served.door._resync
    assert task is not None  # the periodic pass: a task on the server's loop
    return asyncio.run_coroutine_threadsafe(coro, task.get_loop()).result(120)


def models(served: Served) -> set[str]:
    r = httpx.get(served.url + "/v1/models", headers=KEY, timeout=30)
    assert r.status_code == 200, r.text
    return {m["id"] for m in r.json()["data"]}


def complete(served: Served, model: str) -> httpx.Response:
    body = {"model": model, "prompt": f"Shared adapters, {model}.", "max_tokens": 2,
            "temperature": 0}  # fmt: skip
    return httpx.post(served.url + "/v1/completions", json=body, headers=KEY, timeout=120)


def passes(n: int) -> None:
    """Long enough for ``n`` periodic passes of both front doors."""
    time.sleep(n * RESYNC_S + 0.5)


def test_a_load_through_one_front_door_is_routed_by_the_other_and_kept(
    fleet: Fleet, tmp_path: Path
) -> None:
    path = make_adapter(tmp_path / "x1", 31, **SHAPES[4])
    on_loop(fleet.a, fleet.a.door.load_lora("x1", path))
    assert {rid for rid, names in fleet.held().items() if "x1" in names} == {"s0", "s1"}
    passes(4)  # B's resync ran: with a registry of its own it removed x1 everywhere
    assert all("x1" in names for names in fleet.held().values()), fleet.held()
    assert "x1" in models(fleet.b)  # seen within a poll (LORA_POLL_S)
    r = complete(fleet.b, "x1")
    assert r.status_code == 200, r.text
    assert r.headers[REPLICA_HEADER] in {"s0", "s1"}
    assert fleet.b.door.loras.holders("x1") == {"s0", "s1"}
    assert complete(fleet.a, "x1").status_code == 200


def test_an_unload_through_the_other_front_door_is_a_404_and_stays_unloaded(
    fleet: Fleet, tmp_path: Path
) -> None:
    path = make_adapter(tmp_path / "x2", 32, **SHAPES[4])
    on_loop(fleet.a, fleet.a.door.load_lora("x2", path))
    wait_for(lambda: "x2" in models(fleet.b), 20, "B lists x2")
    on_loop(fleet.b, fleet.b.door.unload_lora("x2"))
    passes(4)  # A's resync ran: with a registry of its own it put x2 back everywhere
    assert not any("x2" in names for names in fleet.held().values()), fleet.held()
    wait_for(lambda: complete(fleet.a, "x2").status_code == 404, 20, "A answers x2 with 404")
    assert "x2" not in models(fleet.a)


def test_an_unload_through_one_front_door_fails_none_of_the_others_requests(
    fleet: Fleet, tmp_path: Path
) -> None:
    """B keeps sending requests on x4 while A unloads it. B learns of the unload within a
    poll; until then it routes x4 as before, so A must not take x4 off the replicas before
    every front door has had that poll. Each of B's requests is served (200) or, once B
    knows, refused as unknown (404): none fails on a replica that lost its adapter."""
    path = make_adapter(tmp_path / "x4", 36, **SHAPES[4])
    on_loop(fleet.a, fleet.a.door.load_lora("x4", path))
    wait_for(lambda: "x4" in models(fleet.b), 20, "B lists x4")
    statuses: list[int] = []
    bodies: list[str] = []
    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            r = complete(fleet.b, "x4")
            statuses.append(r.status_code)
            if r.status_code not in (200, 404):
                bodies.append(r.text)

    threads = [threading.Thread(target=traffic) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: statuses.count(200) >= 3, 30, "B serves x4")
        on_loop(fleet.a, fleet.a.door.unload_lora("x4"))
        wait_for(lambda: statuses[-3:] == [404] * 3, 10, "B refuses x4")
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert set(statuses) <= {200, 404}, bodies[:3]
    assert not any("x4" in names for names in fleet.held().values())


def test_no_sync_touches_an_adapter_another_front_door_is_loading(
    fleet: Fleet, tmp_path: Path
) -> None:
    """Between a load's start at the registry and its end, the replicas hold an adapter it
    does not list yet: no front door's pass may remove it. Once the load fails (ended
    without a folder), the passes remove it."""
    path = make_adapter(tmp_path / "mid", 34, **SHAPES[4])
    assert ray.get(fleet.shared.begin_load.remote("mid"), timeout=30) is None
    ray.get(fleet.actors["s1"].add_lora.remote("mid", path), timeout=60)  # the load's call
    passes(4)
    assert "mid" in fleet.held()["s1"]
    assert "mid" not in models(fleet.a) | models(fleet.b)  # not routable before its end
    ray.get(fleet.shared.end_load.remote("mid", None), timeout=30)
    wait_for(lambda: "mid" not in fleet.held()["s1"], 20, "mid removed from s1")


def test_a_front_door_started_later_takes_the_shared_registry(fleet: Fleet, tmp_path: Path) -> None:
    """ad0 came from the replicas' --lora-modules; unloaded through the API, a new front
    door does not bring it back (the registry, not what it finds, is the truth), and it
    lists and routes what the others loaded. An adapter no one registered, found on a
    replica, is removed (by the registry actor's own call)."""
    if "ad0" in fleet.a.door.loras.paths():
        on_loop(fleet.a, fleet.a.door.unload_lora("ad0"))
    loaded = set(fleet.a.door.loras.paths())
    assert "x1" in loaded  # the first test's
    stray = make_adapter(tmp_path / "stray", 33, **SHAPES[4])
    ray.get(fleet.actors["s0"].add_lora.remote("stray", stray), timeout=60)
    with serve(list(fleet.actors.values()), door_kw=fleet.door_kw()) as c:
        assert models(c) - {"tiny"} == loaded
        assert complete(c, "x1").status_code == 200
        assert complete(c, "ad0").status_code == 404
        passes(2)
    assert all(names == loaded for names in fleet.held().values()), fleet.held()


def test_a_registry_restarted_empty_is_seeded_again_and_strips_no_replica(
    fleet: Fleet, tmp_path: Path
) -> None:
    """Its node died (here: killed, Ray restarts it empty): the first front door to poll
    it seeds it with its own copy, so the replicas keep every adapter through both front
    doors' passes, and a load through the other front door works on the new registry."""
    before = ray.get(fleet.shared.view.remote(), timeout=30)
    loaded = set(fleet.a.door.loras.paths())
    assert loaded, "the earlier tests left adapters loaded"
    ray.kill(fleet.shared, no_restart=False)

    def reseeded() -> bool:
        try:
            view = ray.get(fleet.shared.view.remote(), timeout=10)
        except ray.exceptions.RayError:
            return False  # still restarting
        return view.epoch != before.epoch and view.seeded

    wait_for(reseeded, 60, "the restarted registry seeded by a front door")
    view = ray.get(fleet.shared.view.remote(), timeout=30)
    assert set(view.adapters) == loaded
    passes(4)
    assert all(loaded <= names for names in fleet.held().values()), fleet.held()
    assert models(fleet.a) - {"tiny"} == loaded == models(fleet.b) - {"tiny"}
    path = make_adapter(tmp_path / "x3", 35, **SHAPES[4])
    on_loop(fleet.b, fleet.b.door.load_lora("x3", path))
    wait_for(lambda: "x3" in models(fleet.a), 20, "A lists x3")
    assert complete(fleet.a, "x3").status_code == 200


def test_the_registry_decides_one_load_or_unload_per_name_and_forgets_a_dead_one() -> None:
    """The actor's rules, in this process (its calls run one at a time in Ray)."""
    reg = SharedLoRAs()
    first = reg.seed({"ad0": "/a/ad0"}, {"ad0": frozenset({"s0"})})
    assert reg.seed({"other": "/a/other"}, {}).adapters == first.adapters  # seeded once
    assert reg.view(first.version, first.epoch) is None  # nothing new: the poll's cheap answer
    assert reg.begin_load("ad0") == "loaded"
    assert reg.begin_load("x") is None
    assert reg.begin_load("x") == "busy" and reg.begin_unload("x", 60) == "busy"
    pending = reg.view(first.version, first.epoch)
    assert pending is not None and pending.pending == {"x"} and "x" not in pending.adapters
    reg.end_load("x", "/a/x", frozenset({"s0", "s1"}))
    assert reg.listed("x", "/a/x") and not reg.listed("x", "/b/x")
    assert reg.begin_unload("x", 60) is None and not reg.listed("x", "/a/x")
    assert reg.begin_load("x") == "busy"  # until its unloader says it is done
    reg.end_unload("x")
    assert reg.begin_unload("x", 60) == "unknown"
    assert reg.begin_load("y", lease_s=-1) is None  # its front door died mid-load
    assert reg.begin_load("y") is None  # the lease ran out: the name is free again
    assert reg.view(reg.version, reg.epoch) is None
    assert reg.view(reg.version, "an earlier registry's") is not None  # a restart: all of it


def test_an_unload_is_drained_once_every_polling_front_door_copied_it_and_ended_its_requests() -> (
    None
):
    reg = SharedLoRAs()
    v = reg.seed({"a": "/a/a"}, {})
    reg.view(v.version, v.epoch, "door-b")  # B has copied the registry, no request on "a"
    assert reg.begin_unload("a", 60) is None
    assert not reg.drained("a")  # B still routes "a": it has not copied the unload
    b = reg.view(v.version, v.epoch, "door-b")  # B's poll that copies it
    assert b is not None and "a" not in b.adapters
    assert not reg.drained("a")  # reported before B applied it
    reg.view(b.version, b.epoch, "door-b", frozenset({"a"}))
    assert not reg.drained("a")  # copied, but one of B's requests still runs on "a"
    reg.view(b.version, b.epoch, "door-b")
    assert reg.drained("a")
    reg.doors["door-c"] = (time.monotonic() - DOOR_TTL_S - 1, -1, frozenset({"a"}))
    assert reg.drained("a") and "door-c" not in reg.doors  # silent: died, not waited for
    reg.view(b.version, "an earlier registry's", "door-d")
    assert not reg.drained("a")  # a copy of another epoch has not seen this unload
    reg.end_unload("a")
    assert reg.drained("a")
