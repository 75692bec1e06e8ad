"""The front door's worker thread (router/api/worker.py) says it is idle only while no job
runs there or waits for it, however its jobs end: returned, raised, or cancelled before
they ran."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvroute.router.api.worker import Worker


def test_idle_only_while_nothing_runs_or_waits() -> None:
    async def main() -> None:
        worker = Worker("test-worker")
        assert worker.idle()
        gate = threading.Event()
        first = asyncio.ensure_future(worker.run(gate.wait))
        second = asyncio.ensure_future(worker.run(lambda: 2))
        await asyncio.sleep(0.05)
        assert not worker.idle()  # one runs, one waits
        second.cancel()  # cancelled while it waits: it never runs
        await asyncio.sleep(0.05)
        assert not worker.idle()  # the first still runs
        gate.set()
        assert await first is True
        await asyncio.sleep(0.05)
        assert worker.idle()

        def boom() -> None:
            raise ValueError("boom")

        with pytest.raises(ValueError):
            await worker.run(boom)
        assert worker.idle()
        assert await worker.run(lambda: threading.current_thread().name) != "MainThread"
        worker.close()

    asyncio.run(main())
