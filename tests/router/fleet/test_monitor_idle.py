"""The fleet monitor's rounds come as far apart as nothing needs them sooner, and still find
a failure when it is due: a replica that pushes its load is checked at its silence deadline
(and found silent there), an HTTP backend when its next /metrics read is due, a replica
polled over Ray (or one without a connection yet) every ``load_interval_s`` as before.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

import zmq

from kvroute.events import dataplane_wire as dp
from kvroute.events.load import LoadReport
from kvroute.router.backends.control import BackendSpec, HttpBackend
from kvroute.router.fleet.fleet_monitor import FleetMonitor
from kvroute.router.fleet.replica_connection import ReplicaConnection
from kvroute.router.routing.load import LoadTracker


def report(running: int) -> LoadReport:
    return LoadReport(
        num_waiting=0, num_running=running, num_decoding=running, queued_prefill_tokens=0,
        decode_context_tokens=0, free_blocks=60, total_blocks=100,
    )  # fmt: skip


class Rep:
    def __init__(self, actor: Any, endpoint: str = "", conn: Any = None) -> None:
        self.actor, self.conn, self.alive = actor, conn, True
        self.info: Any = type("I", (), {"data_endpoint": endpoint, "incarnation": "x"})()


class Monitor(FleetMonitor):
    def __init__(self, reps: dict[str, Rep]) -> None:
        self.replicas = reps  # type: ignore[assignment]
        self.draining, self.cordoned = set(), set()
        self.errors = Counter()
        self.load = LoadTracker()
        self.load_interval_s, self.monitor_interval_s = 0.2, 2.0
        self.rounds = 0

    def alive(self) -> list[str]:
        return [rid for rid, rep in self.replicas.items() if rep.alive]

    def fail(self, rid: str) -> None:
        self.replicas[rid].alive = False

    async def _poll(self, rid: str) -> None:  # info() over Ray: not this test's business
        return None

    async def _watch_round(self, last_poll: float) -> float:
        self.rounds += 1
        return await super()._watch_round(last_poll)


def backend(running: int) -> HttpBackend:
    spec = BackendSpec.parse("http://127.0.0.1:1=tcp://127.0.0.1:2")
    info: Any = type("I", (), {"block_size": 32, "incarnation": "b@1"})()
    b = HttpBackend(spec, info, block_size=32, min_load_interval_s=0.5, idle_load_interval_s=2.0)
    b._report, b._report_at = report(running), time.monotonic()
    return b


class Pushed:
    """A connection whose replica pushes its load (heard ``ago`` seconds before)."""

    def __init__(self, ago: float) -> None:
        self.loads, self.lost, self.last_heard = 3, None, time.monotonic() - ago

    def silence_due_in(self, now: float) -> float:
        return self.last_heard + dp.SILENCE_TIMEOUT_S - now


def test_an_idle_backend_or_a_pushing_replica_wakes_the_monitor_seldom() -> None:
    idle = Monitor({"b": Rep(backend(0))})
    assert 1.9 <= idle._round_delay(time.monotonic()) <= 2.01  # the idle read, 2 s on
    busy = Monitor({"b": Rep(backend(2))})
    assert 0.45 <= busy._round_delay(time.monotonic()) <= 0.51  # a busy one's, 0.5 s on
    pushed = Monitor({"r": Rep(object(), "tcp://x", Pushed(ago=dp.SILENCE_TIMEOUT_S - 0.7))})
    assert 0.6 <= pushed._round_delay(time.monotonic()) <= 0.71  # its silence deadline
    heard = Monitor({"r": Rep(object(), "tcp://x", Pushed(ago=0.0))})
    assert 1.9 <= heard._round_delay(time.monotonic()) <= 2.0  # the next info() poll
    # As before: a replica polled over Ray, or one still to connect, every load_interval_s.
    polled = Monitor({"r": Rep(object()), "b": Rep(backend(0))})
    assert polled._round_delay(time.monotonic()) == 0.2
    unconnected = Monitor({"r": Rep(object(), "tcp://x"), "b": Rep(backend(0))})
    assert unconnected._round_delay(time.monotonic()) == 0.2


def test_a_cached_backend_report_stays_fresh_in_the_load_view_until_its_next_read() -> None:
    """Rounds 2 s apart over an idle backend: the report it stands by is fresh meanwhile."""

    async def main() -> None:
        b = backend(0)
        monitor = Monitor({"b": Rep(b)})
        await monitor._watch_round(time.monotonic())
        now = time.monotonic()
        got, at = monitor.load.report_of("b")
        assert got is b._report and now - 0.1 <= at <= now  # when it was confirmed
        assert monitor.load.get("b", now + 2.5)[4] == 60  # fresh past the next round
        assert monitor.load.get("b", now + 3.5)[4] == 100  # then stale: its own count

    asyncio.run(main())


def test_a_silent_replica_is_lost_at_its_deadline_with_few_rounds_before() -> None:
    """A real connection whose replica went quiet: the monitor sleeps to its deadline and
    finds it silent there, without the 0.2 s rounds it used to run meanwhile."""

    async def main() -> None:
        ctx = zmq.Context.instance()
        router = ctx.socket(zmq.ROUTER)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        lost: list[tuple[str, str]] = []
        conn = ReplicaConnection(
            "r", f"tcp://127.0.0.1:{port}", "x", "fd-test", lambda r, why: lost.append((r, why))
        )
        conn.loads = 1  # it pushes its load: nothing to poll
        conn.last_heard = time.monotonic() - dp.SILENCE_TIMEOUT_S + 0.6  # 0.6 s to go
        monitor = Monitor({"r": Rep(object(), "tcp://x", conn)})
        monitor.monitor_interval_s = 30.0
        start = time.monotonic()
        task = asyncio.get_running_loop().create_task(monitor._watch())
        try:
            while not lost and time.monotonic() - start < 3.0:
                await asyncio.sleep(0.02)
        finally:
            task.cancel()
            conn.close()
            router.close(linger=0)
        took = time.monotonic() - start
        assert lost and lost[0][0] == "r" and "silent" in lost[0][1]
        assert 0.55 <= took <= 0.9, took  # at its deadline, as soon as 0.2 s rounds would
        assert monitor.rounds <= 2, monitor.rounds  # not one round per 0.2 s

    asyncio.run(main())


def test_a_busy_backend_that_only_this_router_feeds_is_read_every_idle_interval() -> None:
    """The monitor tells an HTTP backend how many requests the router has there after each
    read: one that runs no more (this router's alone) is next read 2 s on, not 0.5 s; one
    that runs more (another client too) 0.5 s on. Its counts stand in the view no longer
    than a shared backend's."""

    async def main() -> None:
        b = backend(0)
        b._report_at = float("-inf")  # a read is due
        running = [2]

        async def metrics() -> Any:
            from kvroute.router.backends.control import BackendMetrics

            return BackendMetrics(running=float(running[0]), cache_config={})

        b._metrics = metrics  # type: ignore[method-assign]
        monitor = Monitor({"b": Rep(b)})
        for i in range(2):  # the router's two requests there
            monitor.load.on_routed(f"q{i}", "b", prefill=10, context=10)
        await monitor._watch_round(time.monotonic())
        assert not b.shared
        assert 1.9 <= monitor._round_delay(time.monotonic()) <= 2.01
        now = time.monotonic()
        assert monitor.load.get("b", now)[3] == 2
        monitor.load.on_finished("q0")  # the report's count is not kept past 1.5 s
        assert monitor.load.get("b", now + 1.6)[3] == 1
        running[0] = 3  # a request from elsewhere
        b._report_at = float("-inf")
        await monitor._watch_round(time.monotonic())
        assert b.shared
        assert 0.45 <= monitor._round_delay(time.monotonic()) <= 0.51

    asyncio.run(main())
