"""The fleet's monitor: each replica's health, restarts and load, watched on the loop.

Why a module of its own: :class:`~.fleet.Fleet` is membership, sockets and the feeds into
routing; the monitor is the one periodic task beside them. Every ``load_interval_s`` it
opens a data-plane connection to each live replica that lacks one (and checks its
silence), and polls the load report of each replica that does not push it over that
connection (one whose actor has ``cached_load``, an HTTP backend, is asked first whether a
read is due: when not, its last report is taken without a call); every
``monitor_interval_s`` it asks each replica's ``info()`` over Ray, and follows a restart
(a new incarnation: new endpoints), a drain, a recovery or a death.

Rounds are as far apart as nothing needs them sooner: ``load_interval_s`` while some
replica's load is polled (or a connection is to be made), else until the next of a
connection's silence deadline, an HTTP backend's next due read, and the next
``monitor_interval_s`` poll. An idle front door over replicas that push their load, or
over ``vllm serve`` backends, so wakes every second or two, not five times a second, and
a silent replica is found at its deadline, as soon as before.

A mixin of :class:`~.fleet.Fleet`: it reads and changes the fleet's own state (replicas,
draining, cordoned, errors, the load view, the subscriber) through the fleet's methods
(``add``, ``fail``, ``connection``, ``_prepare``), on the loop like everything else there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvroute.events.replica_api import ReplicaInfo
    from kvroute.events.transport import ZmqEventSubscriber

    from ..routing.load import LoadTracker
    from .fleet import ReplicaHandle

# A round woken a hair early must still find a read due (else it waits one more floor).
TIMER_SLACK_S = 0.002

log = logging.getLogger("kvroute.router.fleet.fleet")  # the fleet's: its messages, as before


class FleetMonitor:
    """The monitor's rounds (see the module doc); ``Fleet.start`` runs :meth:`_watch`."""

    if TYPE_CHECKING:  # the fleet's own
        replicas: dict[str, ReplicaHandle]
        draining: set[str]
        cordoned: set[str]
        errors: Counter[str]
        load: LoadTracker
        subscriber: ZmqEventSubscriber
        load_interval_s: float
        monitor_interval_s: float

        def alive(self) -> list[str]: ...
        def fail(self, rid: str) -> None: ...
        def connection(self, rid: str) -> Any: ...
        def _rejoin(self, rid: str, actor: Any, info: ReplicaInfo) -> None: ...
        async def _prepare(self, actor: Any, info: ReplicaInfo) -> None: ...

    async def _watch(self) -> None:
        """Every ``load_interval_s``: a data-plane connection to each live replica (its
        silence checked), and the :class:`LoadReport` of each replica that does not push
        its load over that connection, polled over Ray instead (the path the simulator's
        reports take too); every ``monitor_interval_s``: restarts and recoveries."""
        last_poll = time.monotonic()
        delay = self._round_delay(last_poll)
        while True:
            await asyncio.sleep(delay)
            try:
                last_poll = await self._watch_round(last_poll)
                delay = self._round_delay(last_poll)
            except Exception:  # one round's surprise must not end the monitor
                self.errors["monitor_failed"] += 1
                log.exception("the fleet monitor's round failed")
                delay = min(self.load_interval_s, self.monitor_interval_s)

    def _round_delay(self, last_poll: float) -> float:
        """Seconds to the next round: to whatever is due first (see the module doc), at
        least ``load_interval_s`` and at most to the next ``monitor_interval_s`` poll."""
        now = time.monotonic()
        floor = min(self.load_interval_s, self.monitor_interval_s)
        due = last_poll + self.monitor_interval_s - now
        for rid in self.alive():
            rep = self.replicas[rid]
            conn = rep.conn
            if conn is None and rep.info.data_endpoint:
                return floor  # a connection to make
            if conn is not None and conn.lost is None:
                due = min(due, conn.silence_due_in(now))
                if conn.loads:
                    continue  # its load comes pushed
            due_in = getattr(type(rep.actor), "load_due_in", None)
            if due_in is None:
                return floor  # its load is polled over Ray every round
            due = min(due, due_in(rep.actor, now) + TIMER_SLACK_S)
        return max(floor, due)

    async def _watch_round(self, last_poll: float) -> float:
        """One round of :meth:`_watch`; returns when replicas were last polled."""
        now = time.monotonic()
        polled = []  # replicas whose load does not come over the data plane (yet)
        for rid in self.alive():
            rep = self.replicas[rid]
            if rep.conn is None and rep.info.data_endpoint:
                self.connection(rid)  # every front door connects to every replica
            if rep.conn is not None:
                rep.conn.check_silence(now)
            if rep.conn is None or rep.conn.lost is not None or not rep.conn.loads:
                # A replica that paces its own reads (an HTTP backend) says when one is not
                # due: its last report is taken as is, with no call and no task.
                cached = getattr(type(rep.actor), "cached_load", None)
                report = cached(rep.actor) if cached is not None else None
                if report is not None:  # good until the backend reads again
                    good_for = type(rep.actor).good_for(rep.actor, now)
                    self.load.report(rid, report, now, good_for)
                else:
                    polled.append(rid)
        if polled:
            await asyncio.gather(*(self._load_report(rid) for rid in polled))
        if time.monotonic() - last_poll >= self.monitor_interval_s:
            last_poll = time.monotonic()
            await asyncio.gather(*(self._poll(rid) for rid in list(self.replicas)))
        return last_poll

    async def _load_report(self, rid: str) -> None:
        rep = self.replicas.get(rid)
        if rep is None:
            return
        own = self.load.in_flight_at(rid)
        try:
            report = await asyncio.wait_for(rep.actor.load.remote(), self.monitor_interval_s)
        except Exception:  # a failing replica is the monitor's business, not the load view's
            self.errors["load_report_failed"] += 1
            return
        if rep.alive and self.replicas.get(rid) is rep:
            now = time.monotonic()
            observe = getattr(type(rep.actor), "observe", None)
            if observe is None:
                self.load.report(rid, report, now)
                return
            # An HTTP backend: whether it serves this router alone paces its reads.
            observe(rep.actor, max(own, self.load.in_flight_at(rid)))
            self.load.report(rid, report, now, type(rep.actor).good_for(rep.actor, now))

    async def _poll(self, rid: str) -> None:
        rep = self.replicas.get(rid)
        if rep is None:
            return
        try:
            info = await asyncio.wait_for(rep.actor.info.remote(), self.monitor_interval_s * 5)
        except Exception as exc:
            if self.replicas.get(rid) is not rep:  # removed (or replaced) meanwhile
                return
            if rep.alive and rid not in self.draining:
                log.warning("replica %s does not answer (%s)", rid, type(exc).__name__)
            self.fail(rid)
            return
        if self.replicas.get(rid) is not rep:  # removed (or replaced) while it answered
            return
        if not info.draining and rid in self.draining:  # drained, then taken back
            self.draining.discard(rid)
            self.cordoned.discard(rid)
            log.warning("replica %s is no longer draining", rid)
        if info.draining and rid not in self.draining:
            log.warning("replica %s is draining: no new requests go to it", rid)
            self.draining.add(rid)
            self.cordoned.add(rid)
        if info.incarnation != rep.info.incarnation:
            log.warning("replica %s restarted: following its new endpoints", rid)
            rep.alive = False  # not routed to while it is prepared
            await self._prepare(rep.actor, info)
            if self.replicas.get(rid) is not rep:
                return
            self._rejoin(rid, rep.actor, info)
        elif not rep.alive:
            # The same process answers info() even while its engine is dead (it exits a
            # moment later, so Ray restarts it): only a passing health check brings it back.
            try:
                await asyncio.wait_for(rep.actor.health.remote(), self.monitor_interval_s * 5)
            except Exception:
                return
            if self.replicas.get(rid) is not rep:
                return
            rep.alive = True  # the same process, healthy again (a transient failure)
            self.connection(rid)
            self.subscriber.add_publisher(
                rid, info.events_endpoint, info.replay_endpoint, info.topic
            )
            log.info("replica %s is back", rid)
