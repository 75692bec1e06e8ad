"""How often a fronted ``vllm serve``'s ``/metrics`` is read (:class:`HttpBackend`'s pacing):
less often while it is idle or runs only this router's requests, info() riding on the
load's reads, and the fleet monitor taking a report that is not due without a call.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))  # type: ignore[arg-type]


def test_an_idle_backends_load_is_read_less_often() -> None:
    from kvroute.router.backends.control import BackendMetrics, BackendSpec, HttpBackend

    async def main() -> None:
        spec = BackendSpec.parse("http://127.0.0.1:1=tcp://127.0.0.1:2")
        info: Any = type("I", (), {"block_size": 32})()
        backend = HttpBackend(spec, info, min_load_interval_s=0.0, idle_load_interval_s=3600)
        reads: list[float] = []
        running = [2.0]

        async def metrics() -> BackendMetrics:
            reads.append(running[0])
            return BackendMetrics(running=running[0])

        backend._metrics = metrics  # type: ignore[method-assign]
        await backend.load.remote()
        await backend.load.remote()
        assert len(reads) == 2  # busy: every call reads (min interval 0)
        running[0] = 0.0
        await backend.load.remote()
        await backend.load.remote()
        assert len(reads) == 3  # idle now: the next read waits for the idle interval

    run(main())


def test_a_backend_that_serves_this_router_alone_is_read_less_often() -> None:
    """A busy backend whose read counts no more requests than the router has there is
    read every ``idle_load_interval_s``; its report stands in the load view no longer than
    a shared one's. One that counts more (another client) is read every
    ``min_load_interval_s`` again."""
    from kvroute.router.backends.control import BackendMetrics, BackendSpec, HttpBackend

    async def main() -> None:
        spec = BackendSpec.parse("http://127.0.0.1:1=tcp://127.0.0.1:2")
        info: Any = type("I", (), {"block_size": 32})()
        backend = HttpBackend(spec, info, min_load_interval_s=0.5, idle_load_interval_s=2.0)
        running = [3.0]

        async def metrics() -> BackendMetrics:
            return BackendMetrics(running=running[0], waiting=1.0 if running[0] else 0.0)

        backend._metrics = metrics  # type: ignore[method-assign]
        await backend.load.remote()
        now = backend._report_at
        assert backend.shared  # not known yet: as a shared one
        assert 0.49 <= backend.load_due_in(now) <= 0.5
        backend.observe(4)  # 3 running + 1 waiting, all the router's
        assert not backend.shared
        assert 1.99 <= backend.load_due_in(now) <= 2.0
        assert 0.49 <= backend.good_for(now) <= 0.5  # its counts no staler than before
        assert backend.good_for(now + 1.0) == 0.0
        running[0] = 5.0
        backend._report_at = float("-inf")  # due: the next call reads
        await backend.load.remote()
        backend.observe(4)  # 6 there, 4 of them the router's: someone else sends too
        assert backend.shared
        assert 0.49 <= backend.load_due_in(backend._report_at) <= 0.5
        running[0] = 0.0
        backend._report_at = float("-inf")
        await backend.load.remote()
        backend.observe(0)
        idle_at = backend._report_at  # idle: its report stands until the next read
        assert 1.99 <= backend.good_for(idle_at) <= 2.0

    run(main())


def test_info_rides_on_the_loads_reads_of_a_backend_read_every_2_s() -> None:
    """A backend read every ``idle_load_interval_s`` (this router's alone): the monitor's
    info() poll reuses the load's last read within that interval, so the load's reads
    (after which the monitor tells the backend its count) are the only periodic ones."""
    from kvroute.router.backends.control import BackendMetrics, BackendSpec, HttpBackend

    async def main() -> None:
        spec = BackendSpec.parse("http://127.0.0.1:1=tcp://127.0.0.1:2")
        info: Any = type(
            "I", (), {"block_size": 32, "topic": "kv", "incarnation": "b@7", "data_endpoint": ""}
        )()
        backend = HttpBackend(spec, info, block_size=32, min_load_interval_s=0.2,
                              idle_load_interval_s=0.6)  # fmt: skip
        backend._models = {"data": [{"id": "m", "root": "/nowhere/m"}]}
        reads: list[float] = []

        async def metrics() -> BackendMetrics:
            reads.append(time.monotonic())
            return BackendMetrics(running=2.0, start_time="7")

        backend._metrics = metrics  # type: ignore[method-assign]
        await backend.load.remote()
        backend.observe(2)  # both running requests are this router's
        await asyncio.sleep(0.3)  # past min_load_interval_s, within idle_load_interval_s
        await backend.info.remote()
        assert len(reads) == 1
        await asyncio.sleep(0.35)  # past the interval: a read of its own (liveness)
        await backend.info.remote()
        assert len(reads) == 2
        backend.observe(1)  # a request from elsewhere: read every 0.2 s again
        await asyncio.sleep(0.25)
        await backend.info.remote()
        assert len(reads) == 3

    run(main())


def test_a_load_poll_not_due_costs_the_monitor_no_call_and_info_reuses_its_rounds_read() -> None:
    """The fleet monitor's rounds (every 0.2 s) over an HTTP backend: while no read of
    /metrics is due the backend's last report goes to the load view as before (fresh
    each round), with no ``load.remote()`` call; a round's info() poll reuses the read its
    load poll just made, and a later one reads again."""
    import time
    from collections import Counter

    from kvroute.events.load import LoadReport
    from kvroute.router.backends import control
    from kvroute.router.backends.control import BackendMetrics, BackendSpec, HttpBackend
    from kvroute.router.fleet.fleet_monitor import FleetMonitor

    reads: list[str] = []

    class Backend(HttpBackend):
        async def _metrics(self) -> BackendMetrics:
            reads.append("metrics")
            return BackendMetrics(running=1.0, start_time="7")

    reported: list[tuple[str, LoadReport, float]] = []

    class Load:
        def report(self, rid: str, report: LoadReport, now: float, good_for: float = 0) -> None:
            reported.append((rid, report, now))

        def in_flight_at(self, rid: str) -> int:
            return 0  # the backend runs a request the router did not send: shared

    class Rep:
        def __init__(self, actor: Any, info: Any) -> None:
            self.actor, self.info, self.conn, self.alive = actor, info, None, True

    class Monitor(FleetMonitor):
        def __init__(self, actor: Any, info: Any) -> None:
            self.replicas = {"b": Rep(actor, info)}
            self.draining, self.cordoned = set(), set()
            self.errors = Counter()
            self.load = Load()  # type: ignore[assignment]
            self.load_interval_s, self.monitor_interval_s = 0.2, 2.0

        def alive(self) -> list[str]:
            return ["b"]

    async def main() -> None:
        spec = BackendSpec.parse("http://127.0.0.1:1=tcp://127.0.0.1:2")
        info: Any = type(
            "I", (), {"block_size": 32, "topic": "kv", "incarnation": "b@7", "data_endpoint": ""}
        )()
        backend = Backend(spec, info, block_size=32, min_load_interval_s=0.5)
        backend._models = {"data": [{"id": "m", "root": "/nowhere/m"}]}
        calls = [0]
        get_load = backend._get_load

        async def counted() -> LoadReport:
            calls[0] += 1
            return await get_load()

        backend.load = control._Call(counted)
        monitor = Monitor(backend, info)
        last = await monitor._watch_round(time.monotonic())  # no report yet: a read
        assert (calls[0], reads, len(reported)) == (1, ["metrics"], 1)
        for _ in range(3):  # not due (0.5 s): the last report, no call, reported each round
            last = await monitor._watch_round(last)
        assert (calls[0], len(reads), len(reported)) == (1, 1, 4)
        assert all(r[1] is reported[0][1] for r in reported)
        assert reported[-1][2] > reported[0][2]  # fresh in the load view as before
        got = await backend.info.remote()  # a read within the load's 0.5 s stands for one
        assert len(reads) == 1 and got.incarnation == "127.0.0.1:1@7"
        await asyncio.sleep(control.SAME_ROUND_S + 0.02)
        await backend.info.remote()
        assert len(reads) == 1  # still within min_load_interval_s: no read of its own
        await asyncio.sleep(0.5)
        await backend.info.remote()  # past it: info reads (liveness), and that read ...
        assert len(reads) == 2
        assert backend.cached_load() is not None  # ... serves the load view as well
        await asyncio.sleep(0.55)
        assert backend.cached_load() is None  # due again: the next round reads
        await monitor._watch_round(time.monotonic())
        assert (calls[0], len(reads)) == (2, 3)

    run(main())
