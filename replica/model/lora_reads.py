"""Adapter files are read off the engine's thread, each read under a deadline.

Why: an adapter's folder may sit on a network mount, and a read of a hung mount -- or of a
FIFO left where a file should be -- never returns. Read on the engine's thread, it would
hold every request of every tenant on the replica while ``/health`` still said ok. So every
read of an adapter (the check at registration, the weights when a request first needs
them) runs on a thread of :class:`AdapterReads`, and waits at most ``timeout_s`` once it
has started: past that it is abandoned -- its future fails with :class:`ReadTimeoutError`,
so its requests fail and a load is refused -- and it is logged and counted (``timed_out``,
reported to routers for ``/metrics``). The thread itself, which Python cannot stop, runs on
until the file answers.

Why abandoned threads are bounded and set apart: at most ``workers`` reads run at once,
not counting the abandoned ones, so reads that hang cannot starve other adapters' reads;
and once ``max_hung`` abandoned threads are alive, new reads are refused at once (so at
most ``max_hung + workers - 1`` ever hang), since a mount that hangs every read must not
grow threads without end.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from .lora_adapter import LoRAError

__all__ = ["READ_TIMEOUT_S", "AdapterReads", "ReadTimeoutError"]

log = logging.getLogger(__name__)
T = TypeVar("T")

READ_TIMEOUT_S = 20.0  # a read that has not answered by then is abandoned
MAX_READERS = 4  # reads running at once (abandoned ones not counted)
MAX_HUNG = 16  # abandoned threads alive at once; past it new reads are refused


class ReadTimeoutError(LoRAError):
    """An adapter read that did not answer within its deadline (a hung mount)."""


@dataclass(eq=False, slots=True)
class _Read:
    what: str  # for the error and the log: which adapter, which file
    fn: Callable[[], Any]
    future: cf.Future[Any]
    deadline: float = 0.0  # time.monotonic(); set when it starts
    abandoned: bool = False


class AdapterReads:
    """Runs adapter reads on threads of their own, each under a deadline (module docstring).
    Thread-safe: the engine thread, the actor's event loop and the readers all call it."""

    def __init__(
        self,
        timeout_s: float = READ_TIMEOUT_S,
        workers: int = MAX_READERS,
        max_hung: int = MAX_HUNG,
    ) -> None:
        self.timeout_s = timeout_s
        self.workers = workers
        self.max_hung = max_hung
        self._cond = threading.Condition()
        self._queued: deque[_Read] = deque()
        self._running: list[_Read] = []  # started, not abandoned
        self._watchdog: threading.Thread | None = None  # alive while reads run
        self.hung = 0  # abandoned reads whose thread is still alive
        self.timed_out = 0  # reads abandoned at their deadline, in total
        self.failed = 0  # reads that raised, in total

    def submit(self, what: str, fn: Callable[[], T]) -> cf.Future[T]:
        """Runs ``fn`` on a reader thread; its future fails with ReadTimeoutError when it
        has not answered ``timeout_s`` after it started, or at once when ``max_hung``
        abandoned reads are still alive."""
        future: cf.Future[T] = cf.Future()
        future.set_running_or_notify_cancel()
        with self._cond:
            refused = self.hung >= self.max_hung
            if refused:
                self.failed += 1
            else:
                self._queued.append(_Read(what, fn, future))
                self._start()
        if refused:
            future.set_exception(self._too_many(what))
        return future

    def _too_many(self, what: str) -> ReadTimeoutError:
        return ReadTimeoutError(
            f"{what}: not read: {self.hung} earlier adapter reads are still hung (past "
            f"{self.timeout_s:g} s; a stuck mount?)"
        )

    def result(self, what: str, fn: Callable[[], T]) -> T:
        """``fn``'s result, read on a reader thread under the deadline (a caller that may
        block, such as an engine being built)."""
        return self.submit(what, fn).result()

    # -- under self._cond ------------------------------------------------------------------
    def _start(self) -> None:
        while self._queued and len(self._running) < self.workers:
            read = self._queued.popleft()
            if self.hung >= self.max_hung:  # queued while others hung: refused, not started
                self.failed += 1
                read.future.set_exception(self._too_many(read.what))
                continue
            read.deadline = time.monotonic() + self.timeout_s
            self._running.append(read)
            threading.Thread(
                target=self._run, args=(read,), name="kvroute-lora-read", daemon=True
            ).start()
        if self._watchdog is None and self._running:
            self._watchdog = threading.Thread(
                target=self._watch, name="kvroute-lora-deadline", daemon=True
            )
            self._watchdog.start()
        self._cond.notify_all()

    # -- threads ---------------------------------------------------------------------------
    def _run(self, read: _Read) -> None:
        value: Any = None
        error: BaseException | None = None
        try:
            value = read.fn()
        except BaseException as exc:  # whatever a read raises is its own
            error = exc
        with self._cond:
            if read.abandoned:
                self.hung -= 1
                log.warning("%s: a read abandoned at its deadline has ended", read.what)
                self._start()
                return
            self._running.remove(read)
            if error is not None:
                self.failed += 1
            self._start()
        if error is None:
            read.future.set_result(value)
        else:
            read.future.set_exception(error)

    def _watch(self) -> None:
        """Abandons the reads past their deadline; ends when none runs (started again by
        the next read)."""
        with self._cond:
            while True:
                now = time.monotonic()
                late = [r for r in self._running if r.deadline <= now]
                for read in late:
                    read.abandoned = True
                    self._running.remove(read)
                    self.hung += 1
                    self.timed_out += 1
                if late:
                    self._start()
                    self._cond.release()
                    try:
                        for read in late:
                            self._abandon(read)
                    finally:
                        self._cond.acquire()
                    continue
                if not self._running:
                    self._watchdog = None
                    return
                self._cond.wait(max(min(r.deadline for r in self._running) - now, 0.0))

    def _abandon(self, read: _Read) -> None:
        log.error(
            "%s: no answer within %g s; abandoned, its requests fail (%d adapter reads hung)",
            read.what, self.timeout_s, self.hung,
        )  # fmt: skip
        read.future.set_exception(
            ReadTimeoutError(
                f"{read.what}: no answer within {self.timeout_s:g} s (a hung mount, or a "
                "file that never ends?)"
            )
        )
