"""The transport's threading aids (events/transport/threads.py)."""

from __future__ import annotations

import os
import select
import sys
import threading
import time
from pathlib import Path

import pytest

from kvroute.events.transport import ZmqEventPublisher, threads
from kvroute.events.transport.threads import Waker, name_native_thread

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl and /proc")


def os_name(native_id: int) -> str:
    return Path(f"/proc/self/task/{native_id}/comm").read_text().strip()


@linux_only
def test_a_thread_takes_its_python_name_at_the_os_level() -> None:
    seen: list[str] = []

    def run() -> None:
        before = os_name(threading.get_native_id())
        name_native_thread()
        seen.extend([before, os_name(threading.get_native_id())])

    thread = threading.Thread(target=run, name="kvr-a-long-thread-name")
    thread.start()
    thread.join()
    assert seen[0] != "kvr-a-long-thre"  # what the OS called it before: the process's name
    assert seen[1] == "kvr-a-long-thre"  # the first 15 bytes, as the kernel keeps them


@linux_only
def test_the_publishers_thread_is_told_apart_in_top() -> None:
    with ZmqEventPublisher("tcp://127.0.0.1:*", None) as pub:
        native_id = pub._thread.native_id
        assert native_id is not None
        deadline = time.monotonic() + 5
        while os_name(native_id) != "kvr-publisher" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert os_name(native_id) == "kvr-publisher"


@pytest.mark.parametrize("when", ["before the read", "after the read"])
def test_a_wake_that_lands_while_the_waker_drains_is_never_lost(monkeypatch, when: str) -> None:
    """Another thread's ``wake`` may land at any point of ``drain``. Whatever the point, the
    waker must not end up armed over an empty pipe, where every later ``wake`` is a no-op
    and its reader sleeps through them (found in review: disarming before the read)."""
    waker = Waker()
    try:
        waker.wake()
        read = os.read

        def racing_read(fd: int, n: int) -> bytes:
            if when == "before the read":
                waker.wake()
                return read(fd, n)
            data = read(fd, n)
            waker.wake()
            return data

        monkeypatch.setattr(threads.os, "read", racing_read)
        waker.drain()
        monkeypatch.undo()
        waker.wake()  # the reader goes back to sleep on the pipe: this must wake it
        assert select.select([waker.fd], [], [], 0)[0], "a wake was lost"
    finally:
        waker.close()
