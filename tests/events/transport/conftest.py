"""The subscriber on both of its homes: a module that marks its tests with
``pytest.mark.usefixtures("where")`` runs each of them twice, once with the subscriber on its
own thread and once attached to an event loop."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvroute.events.transport import ZmqEventSubscriber


class OnLoop(ZmqEventSubscriber):
    """The subscriber as a front door runs it: moved onto an event loop once that runs
    (here a loop on a thread of its own, so the tests drive it as they drive the thread)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.test_loop = asyncio.new_event_loop()
        self.test_thread = threading.Thread(target=self.test_loop.run_forever, daemon=True)
        self.test_thread.start()
        self._on_test_loop(lambda: self.attach(self.test_loop))
        assert self._thread is None and self._loop is self.test_loop

    def _on_test_loop(self, fn) -> None:
        async def run() -> None:
            fn()

        asyncio.run_coroutine_threadsafe(run(), self.test_loop).result(10)

    def close(self) -> None:
        if self.test_loop.is_closed():
            return
        self._on_test_loop(super().close)
        self.test_loop.call_soon_threadsafe(self.test_loop.stop)
        self.test_thread.join(10)
        self.test_loop.close()


@pytest.fixture(params=["thread", "loop"])
def where(request, monkeypatch):
    """Every test twice: on the subscriber's own thread, and attached to an event loop (the
    test module's ``ZmqEventSubscriber`` is then :class:`OnLoop`)."""
    if request.param == "loop":
        monkeypatch.setattr(request.module, "ZmqEventSubscriber", OnLoop, raising=False)
    return request.param
