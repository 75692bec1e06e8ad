"""The framing both ends of the event stream agree on, and one small threading aid.

Live (PUB):       [topic, seq (8-byte big-endian signed), payload]
Replay request:   DEALER sends [b"", start_seq (8-byte big-endian signed)]
Replay reply:     one [b"", topic, seq, payload] per buffered batch with seq >= start_seq,
                  then the end marker [b"", b"", -1, b""]. (vLLM's own publisher omits the
                  topic frame: [b"", seq, payload]; subscribers accept both.)
Snapshot request: start_seq = SNAPSHOT_REQUEST (-2). The reply is one or more batches, all
                  under the seq S the snapshot is consistent with, the first beginning with
                  AllBlocksCleared, then BlockStored events for every block held; then the
                  end marker. A publisher that knows no snapshots (vLLM) answers with the end
                  marker alone.
Heartbeat:        an empty batch under a fresh seq, sent when no batch went out for a while.
"""

from __future__ import annotations

import os

END_SEQ = -1
SNAPSHOT_REQUEST = -2


def pack_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def unpack_seq(raw: bytes) -> int:
    if len(raw) != 8:
        raise ValueError(f"sequence frame must be 8 bytes, got {len(raw)}")
    return int.from_bytes(raw, "big", signed=True)


# What a DEALER receives to end a reply: [b"", b"" (no topic), -1, b""].
END_MARKER = (b"", b"", pack_seq(END_SEQ), b"")


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
