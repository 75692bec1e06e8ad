"""Membership: the replicas that join and leave a running fleet, read from Ray's names.

Why apart from :class:`~.fleet.Fleet`: the fleet follows the replicas it holds (sockets,
health, restarts); which replicas exist is the cluster's to say. ``kvroute scale`` and the
autoscaler start replicas as Ray actors named ``replica-<id>`` and retire them by killing
them, so every front door lists those names every ``monitor_interval_s`` and acts:

- a name not in the fleet is a replica that started: once it answers it is prepared (the
  fleet's LoRA adapters) and joins, on a task of its own (a slow one holds up nothing);
  one whose configuration differs from the fleet's is refused, and said once;
- a replica of the fleet whose name is gone and that no longer answers has left; one
  whose name now belongs to another actor has left too (names are unique among live
  actors), and the new one joins;
- a failed listing changes nothing, so a replica is never dropped for Ray being busy.

A replica that drains (``ReplicaInfo.draining``) is the fleet's business: it is not routed
to, and leaves as retired, not failed (:meth:`~.fleet.Fleet.remove`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from .fleet import Fleet, FleetMismatchError

log = logging.getLogger(__name__)


class Membership:
    """Joins and removals for ``fleet`` from ``find`` (replica id -> actor, now)."""

    def __init__(self, fleet: Fleet, find: Callable[[], Awaitable[dict[str, Any]]]) -> None:
        self.fleet = fleet
        self.find = find
        self._refused: set[str] = set()  # incarnations refused a join (said once)
        self._joining: dict[str, asyncio.Task[None]] = {}  # replicas being joined now
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Starts looking, on the running loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        for task in (self._task, *self._joining.values()):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _run(self) -> None:
        """Every ``monitor_interval_s``: replicas started since (scale-up) join; replicas
        that no longer exist and no longer answer (retired, killed) are removed, as is one
        whose name now belongs to another actor (the old one is gone: names are unique). A
        failed look changes nothing: a replica is removed only when it is unlisted and dead."""
        while True:
            await asyncio.sleep(self.fleet.monitor_interval_s)
            try:
                await self._round()
            except Exception:  # Ray's listing failed: look again next time
                self.fleet.errors["find_replicas_failed"] += 1
                log.debug("listing the replicas failed", exc_info=True)

    async def _round(self) -> None:
        found = await self.find()
        for rid, rep in list(self.fleet.replicas.items()):
            if rep.info.data_endpoint.startswith(("http://", "https://")):
                continue  # a vllm serve backend: not Ray's to list
            listed = found.get(rid)
            if listed is None and not rep.alive:
                self.fleet.remove(rid)
            elif listed is not None and _actor_id(listed) != _actor_id(rep.actor):
                log.warning("replica %s is a new actor under the old name", rid)
                self.fleet.remove(rid)
        for rid, actor in found.items():
            if rid not in self.fleet.replicas and rid not in self._joining:
                task = asyncio.get_running_loop().create_task(self._join_found(rid, actor))
                self._joining[rid] = task  # joined on its own: a slow one holds up nothing
                task.add_done_callback(lambda _, rid=rid: self._joining.pop(rid, None))

    async def _join_found(self, rid: str, actor: Any) -> None:
        try:
            info = await asyncio.wait_for(actor.info.remote(), self.fleet.monitor_interval_s * 5)
        except Exception:  # still loading its model, or failed: looked at again next time
            return
        if info.incarnation in self._refused or info.draining:
            return
        if rid in self.fleet.replicas:  # added meanwhile (a front door's own start, a restart)
            return
        try:
            await self.fleet.join(actor, info)
        except FleetMismatchError as exc:
            self._refused.add(info.incarnation)
            self.fleet.errors["replica_refused"] += 1
            log.error("a replica that joined is refused: %s", exc)
            return
        except Exception:  # its preparation or connection failed: tried again next round
            self.fleet.errors["replica_join_failed"] += 1
            log.exception("replica %s could not join", rid)
            return
        log.warning("replica %s joined the fleet (%d replicas)", rid, len(self.fleet.replicas))


def _actor_id(actor: Any) -> Any:
    """A Ray actor's id (None for what is not a Ray actor handle: an HTTP backend, a test's)."""
    return getattr(actor, "_actor_id", None)
