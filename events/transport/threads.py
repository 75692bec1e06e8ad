"""Threading aids of the event and data-plane transports (not contract: an OS pipe, ctypes).

:class:`Waker` lets one thread wake another that waits on ZeroMQ sockets without sharing a
socket; :func:`name_native_thread` names OS threads for ``top -H`` and profilers. Used by
the publisher, the subscriber, and the replica's data-plane and engine threads.
"""

from __future__ import annotations

import os


class Waker:
    """A pipe a zmq.Poller can wait on, so a thread blocked in poll() can be woken from
    another thread without sharing a (non-thread-safe) ZeroMQ socket."""

    def __init__(self) -> None:
        self.fd, self._w = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._w, False)
        self._armed = False

    def wake(self) -> None:
        if not self._armed:
            self._armed = True
            try:
                os.write(self._w, b"x")
            except BlockingIOError:  # pipe already full: the reader is awake anyway
                pass

    def drain(self) -> None:
        """Called when poll() saw the pipe readable. One read: ``wake`` writes one byte per
        arming, and anything left (never, short of 4 kB) keeps the pipe readable for the next
        poll -- where reading until EAGAIN would cost a syscall and an exception each time.
        Read, then disarm: disarmed first, a ``wake`` between the two would write a byte this
        read takes, leaving the waker armed over an empty pipe, and every later ``wake`` a
        no-op. This way a ``wake`` that finds it still armed is one the caller, awake and
        about to look at its work, does not need."""
        try:
            os.read(self.fd, 4096)
        except BlockingIOError:
            pass
        self._armed = False

    def close(self) -> None:
        for fd in (self.fd, self._w):
            try:
                os.close(fd)
            except OSError:
                pass


def name_native_thread() -> None:
    """Gives the calling OS thread its Python thread's name (first 15 bytes), so ``top -H``,
    ``/proc/PID/task/*/comm`` and profilers tell the engine, data-plane and publisher threads
    apart instead of showing each as the process's name. Linux only; a no-op elsewhere."""
    import ctypes
    import ctypes.util
    import sys
    import threading

    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        name = threading.current_thread().name.encode()[:15]
        libc.prctl(15, ctypes.c_char_p(name), 0, 0, 0)  # 15: PR_SET_NAME
    except (OSError, AttributeError):
        pass
