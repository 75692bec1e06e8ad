"""Deadline loops for tests that wait on other threads, processes or sockets."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


def poll(cond: Callable[[], bool], timeout: float = 30.0, every: float = 0.02) -> bool:
    """True as soon as ``cond()`` holds, False if it still does not after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(every)
    return cond()


def wait_for(cond: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    """Like :func:`poll`, but a timeout fails the test with ``what`` in the message."""
    assert poll(cond, timeout, every=0.05), f"{what} not reached within {timeout} s"


async def wait_until(
    cond: Callable[[], bool], timeout: float = 20.0, what: str = "condition"
) -> None:
    """:func:`wait_for` on an event loop: the loop runs (other tasks, callbacks) meanwhile."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout} s"
        await asyncio.sleep(0.005)
