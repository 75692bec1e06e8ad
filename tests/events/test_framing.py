"""The framing module's threading aids."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from kvroute.events.framing import name_native_thread
from kvroute.events.publisher import ZmqEventPublisher

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
