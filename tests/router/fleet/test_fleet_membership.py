"""The fleet's membership at runtime (router/fleet/fleet.py: the finder, join, remove, draining),
with stand-in actors whose calls answer after a chosen delay: what Ray's named actors do
when ``kvroute scale`` starts and retires replicas, without Ray.

What it proves: a replica that appears in the listing joins (prepared first); one that
drains is never routed to and leaves as retired, not failed; one removed while the monitor
awaits its answer stays removed and the monitor lives on; a failed listing removes
nothing; a new actor under a known name replaces the old one; membership changes reach
``on_members``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from kvroute.events.replica_api import ReplicaInfo
from kvroute.router.fleet.fleet import Fleet
from kvroute.router.fleet.membership import Membership

from ...waiting import wait_until

_ids = itertools.count()


def info(
    rid: str, draining: bool = False, incarnation: str | None = None, max_model_len: int = 100
) -> ReplicaInfo:
    return ReplicaInfo(
        replica_id=rid, model="m", model_path="/m", hash_algo="xxh3_128", hash_seed="s",
        hash_form="bytes", block_size=16, num_blocks=100, max_model_len=max_model_len,
        data_endpoint="tcp://127.0.0.1:9", events_endpoint="tcp://127.0.0.1:9",
        replay_endpoint=None, topic=rid, node_ip="x", pid=1,
        incarnation=incarnation or f"inc-{rid}", restarted=False, draining=draining,
    )  # fmt: skip


class Call:
    """``actor.method.remote()``: an awaitable answering ``fn()`` after ``delay`` s."""

    def __init__(self, fn: Any, delay: float = 0.0) -> None:
        self.fn, self.delay = fn, delay
        self.asked = 0  # calls made so far

    def remote(self, *args: Any) -> Any:
        self.asked += 1

        async def answer() -> Any:
            await asyncio.sleep(self.delay)
            return self.fn()

        return answer()


class Actor:
    """A replica actor as the fleet calls it; ``_actor_id`` as Ray's handles have one."""

    def __init__(self, rid: str, delay: float = 0.0, max_model_len: int = 100) -> None:
        self.rid, self.draining, self.dead = rid, False, False
        self.max_model_len = max_model_len
        self._actor_id = next(_ids)
        self.info = Call(self._info, delay)
        self.health = Call(lambda: True)
        self.load = Call(self._fail)

    def _info(self) -> ReplicaInfo:
        if self.dead:
            raise RuntimeError("the actor died")
        incarnation = f"inc-{self.rid}-{self._actor_id}"
        return info(self.rid, self.draining, incarnation, self.max_model_len)

    def _fail(self) -> None:
        raise TimeoutError


@dataclass
class Watched:
    """A fleet, its membership watch over a listing the test edits, and what they did."""

    fleet: Fleet
    membership: Membership
    listed: dict[str, Actor]
    prepared: list[str] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)


@contextlib.asynccontextmanager
async def watched(*actors: Actor) -> AsyncIterator[Watched]:
    """The fleet of ``actors``, started with a membership watch over their listing."""
    listed = {a.rid: a for a in actors}
    fleet = Fleet([(a, a._info()) for a in actors], monitor_interval_s=0.05)

    async def find() -> dict[str, Any]:
        return dict(listed)

    w = Watched(fleet, Membership(fleet, find), listed)

    async def prepare(actor: Any, info: ReplicaInfo) -> None:
        w.prepared.append(info.replica_id)

    fleet.prepare = prepare
    fleet.on_members.append(w.sizes.append)
    fleet.start()
    w.membership.start()
    try:
        yield w
    finally:
        await w.membership.close()
        await fleet.close()


async def test_a_listed_replica_joins_prepared_and_a_retired_one_leaves() -> None:
    async with watched(Actor("r0")) as w:
        fleet = w.fleet
        r1 = w.listed["r1"] = Actor("r1")
        await wait_until(lambda: "r1" in fleet.routable(), 5, "r1 joined")
        assert w.prepared == ["r1"]
        assert w.sizes == [2]
        r1.draining = True
        await wait_until(lambda: "r1" in fleet.draining, 5, "r1 draining")
        assert fleet.routable() == ["r0"]
        r1.dead = True
        del w.listed["r1"]
        await wait_until(lambda: "r1" not in fleet.replicas, 5, "r1 gone")
        assert w.sizes == [2, 1]
        assert fleet.errors["replica_failure"] == 0  # retired, not failed
        assert not fleet.draining and not fleet.cordoned


async def test_a_replica_removed_while_the_monitor_awaits_it_stays_removed() -> None:
    slow = Actor("r1", delay=0.2)  # its info() is still on the way when it is removed
    slow.draining = True
    async with watched(Actor("r0"), slow) as w:
        fleet = w.fleet
        await wait_until(lambda: slow.info.asked > 0, 5, "a poll of r1 on its way")
        fleet.fail("r1")  # a draining replica's loss: removed while the poll awaits it
        del w.listed["r1"]
        await asyncio.sleep(0.8)  # the stale answer arrives, and more rounds run
        assert "r1" not in fleet.replicas
        assert "r1" not in fleet.draining and "r1" not in fleet.cordoned
        assert fleet._monitor is not None and not fleet._monitor.done()
        assert fleet.errors["monitor_failed"] == 0


async def test_a_failed_listing_removes_nothing() -> None:
    async with watched(Actor("r0"), Actor("r1")) as w:
        w.fleet.fail("r1")  # dead, but the listing cannot say whether it is gone

        async def broken() -> dict[str, Any]:
            raise ConnectionError("Ray is busy")

        w.membership.find = broken
        await wait_until(lambda: w.fleet.errors["find_replicas_failed"] >= 3, 5, "three looks")
        assert sorted(w.fleet.replicas) == ["r0", "r1"] and w.sizes == []


async def test_a_new_actor_under_a_known_name_replaces_the_old_one() -> None:
    async with watched(Actor("r0"), Actor("r1")) as w:
        new = w.listed["r1"] = Actor("r1")  # the old one retired, a new one took its name
        await wait_until(lambda: w.fleet.replicas.get("r1") is not None
                         and w.fleet.replicas["r1"].actor is new, 5, "the new r1")  # fmt: skip
        assert "r1" in w.fleet.routable()


async def test_a_replica_that_would_shorten_the_fleets_requests_is_refused_once() -> None:
    """The front door admits requests up to the fleet's max_model_len: a joining replica
    that holds less is refused (said once), not routed requests it would fail."""
    async with watched(Actor("r0")) as w:
        w.listed["r1"] = Actor("r1", max_model_len=50)
        await wait_until(lambda: w.fleet.errors["replica_refused"] == 1, 5, "r1 refused")
        await asyncio.sleep(0.3)  # more looks: refused once, never joined
        assert w.fleet.errors["replica_refused"] == 1 and "r1" not in w.fleet.replicas
