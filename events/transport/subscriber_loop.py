"""The subscriber's wait: one thread (or, once attached, an asyncio loop) over every socket.

A mixin of :class:`~.subscriber.ZmqEventSubscriber`, split out so the waiting and the
commands from other threads read apart from what a message means. The thread waits on the
sockets' ``ZMQ_FD`` descriptors with the platform's selector (epoll, kqueue), not
``zmq.Poller`` (two system calls and a scan of every socket per wake-up). A ``ZMQ_FD``
signals edge-like (readable when the socket's state changed, not while messages wait), so
a socket reported ready is drained until ``ZMQ_EVENTS`` says it is empty, and one whose
reading was cut short (a budget) or whose signal a send may have consumed is looked at
again before the next wait.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import selectors
import time
from collections.abc import Callable

import zmq

from .subscription import Subscription
from .threads import Waker, name_native_thread

log = logging.getLogger(__name__)


class SubscriberLoop:
    """The subscriber's selector loop, its commands and its wake-up; the attributes are
    :class:`~.subscriber.ZmqEventSubscriber`'s."""

    _replicas: dict[str, Subscription]
    _commands: queue.SimpleQueue[Callable[[], None]]
    _waker: Waker
    _again: dict[int, Callable[[], None]]
    _running: bool
    _loop: asyncio.AbstractEventLoop | None
    _detaching: bool
    _selector: selectors.BaseSelector

    def _run(self) -> None:
        name_native_thread()
        while self._running and not self._detaching:
            again, self._again = self._again, {}
            timeout = 0.0 if again else self._poll_timeout_s()
            try:
                ready = self._selector.select(timeout)
            except (OSError, ValueError):  # a descriptor closed under it
                if not self._running:
                    break
                raise
            for key, _ in ready:
                again[key.fileobj] = key.data  # type: ignore[index]
            for handler in again.values():
                handler()
            self._check_deadlines()

    def _watch(self, fd: int, handler: Callable[[], None]) -> None:
        if self._loop is not None:
            self._loop.add_reader(fd, handler)
        else:
            self._selector.register(fd, selectors.EVENT_READ, handler)

    def _unwatch(self, sock: zmq.Socket) -> None:
        fd = sock.getsockopt(zmq.FD)
        if self._loop is not None:
            if not self._loop.is_closed():
                self._loop.remove_reader(fd)
            return
        try:
            self._selector.unregister(fd)
        except KeyError:
            pass
        self._again.pop(fd, None)

    def _look_again(self, sock: zmq.Socket, handler: Callable[[], None]) -> None:
        """Run ``handler`` before the next wait: ``sock`` may hold messages its FD will
        not signal again."""
        if self._loop is not None:
            self._loop.call_soon(handler)
        else:
            self._again[sock.getsockopt(zmq.FD)] = handler

    def _on_waker(self) -> None:
        self._waker.drain()
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            self._command(cmd)

    def _command(self, cmd: Callable[[], None]) -> None:
        if not self._running:
            return
        try:
            cmd()
        except Exception:
            log.exception("subscriber command failed")

    def _poll_timeout_s(self) -> float:
        deadlines = [r.deadline for r in self._replicas.values() if r.syncing]
        if not deadlines:
            return 1.0
        return max(0.0, min(deadlines) - time.monotonic() + 0.001)
