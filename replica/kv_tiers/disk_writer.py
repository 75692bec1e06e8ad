"""The disk tier's writes, off the engine thread (issue 38: copies run off the step's path).

:class:`DiskWriter` wraps a :class:`.kv_disk.DiskStore`. The engine thread keeps the
bookkeeping (which blocks the tier holds, the LRU, the capacity) and only *enqueues* file
operations; one writer thread does them in order: write a block's file, or remove one. Until
a write lands, its bytes stay in memory (``_pending``) and :meth:`read` serves them from
there, checked against their xxh3-64 like a file's: a block is loadable from the moment it
is put.

Why drop when the queue is full (not wait): the queue holds at most ``max_queue_bytes`` of
blocks not yet written. A full queue means the disk is slower than evictions come; waiting
would tie every step to the disk's pace, the very thing the writer is for. A dropped block
is only lost (never counted, never announced): asked again, it is recomputed, never wrong.

Why one thread, FIFO: every file this store creates or removes after it opens goes through
the one queue, so operations on one hash happen in the order the engine asked for them. A
block evicted (or cleared) while its write is pending is cancelled: a queued write is
skipped, and the removal queued behind an in-flight one deletes what it wrote. So no file
outlives its entry once the queue drains (:meth:`flush`); meanwhile the folder may hold, on
top of ``capacity_bytes``, at most the one block being written.

Invariants:
- the store's ``entries`` (engine thread) count every block put and not evicted, discarded
  or failed, pending writes included: ``used_bytes <= capacity_bytes`` at every moment;
- ``_pending`` (hash -> write; shared, under ``_lock``) holds each write queued or under
  way and not cancelled; a write leaves it only after its file is in place (so a reader
  that misses it finds the file) or when it fails or is cancelled;
- ``_queued_bytes`` sums the bytes of writes neither finished nor cancelled while queued,
  ``<= max_queue_bytes`` (one block over when a single block is larger);
- a failed write is reported once, by :meth:`poll` on the engine thread, unless the block
  was evicted or discarded since (then there is nothing left to report);
- once ``lost`` is set no write starts (each later one fails, and is reported as such).

Folder lost: the writer thread checks that the store's folder is still there and still
its own (:meth:`.kv_disk.DiskStore.folder_lost`) after a write fails and at least every
``FOLDER_CHECK_S``. Once it is not, ``lost`` says why and the writer writes nothing more
(its writes fail, so none lands in a folder moved elsewhere); the engine's poll turns the
tier off (:meth:`.kv_tiers.KVTiers.poll`).

Stop: :meth:`close` has the writer thread close the store last (its files and folder are
removed: they are tenants' data), after the write under way. A process that leaves through
Python without closing its engine closes its writers at exit; one that is killed (as Ray
ends replicas) cannot: ``kvroute serve`` wipes its local replicas' folders once they are
gone, and the next store to open a folder wipes what an earlier one left.

Thread-safety: :meth:`put`, :meth:`touch`, :meth:`discard`, :meth:`clear`, :meth:`poll`
and :meth:`close` are the engine thread's; :meth:`read` and :meth:`read_pending` run on any
thread (the disk fetchers and readers). The writer thread touches the store only through its
file-system methods.
"""

from __future__ import annotations

import atexit
import errno
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .disk import DiskStore, checksum

log = logging.getLogger(__name__)

DEFAULT_QUEUE_BYTES = 64 << 20  # 32 blocks of an 8B model, 4096 of tiny
# How often, at the least, the writer thread checks that the folder is still its own.
FOLDER_CHECK_S = 1.0
_LIVE: weakref.WeakSet[DiskWriter] = weakref.WeakSet()


@dataclass(slots=True, eq=False)
class _Write:
    block_hash: bytes
    data: memoryview | None  # released once written or cancelled
    digest: int
    size: int
    state: str = "queued"  # -> "writing" -> "done"; or cancelled while "queued"
    cancelled: bool = False
    ok: bool = False


class DiskWriter:
    """A disk store whose writes and removals run on a writer thread, in order."""

    def __init__(self, store: DiskStore, max_queue_bytes: int = DEFAULT_QUEUE_BYTES) -> None:
        self.store = store
        self.max_queue_bytes = max_queue_bytes
        self._ops: deque[_Write | bytes | None] = deque()  # a write, a removal, or stop
        self._pending: dict[bytes, _Write] = {}
        self._unsettled: dict[bytes, _Write] = {}  # engine thread: puts not yet polled
        self._landed: list[_Write] = []
        self._queued_bytes = 0
        self._busy = False
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self.stats = {"written": 0, "write_failures": 0, "dropped": 0}
        self.lost: str | None = None  # why the folder no longer serves (the writer's)
        self._checked_at = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="kv-disk-writer", daemon=True)
        self._thread.start()
        _LIVE.add(self)

    # -- the store's face (for KVTiers and tests) ----------------------------------------
    @property
    def path(self) -> Path:
        return self.store.path

    def file_of(self, block_hash: bytes) -> Path:
        return self.store.file_of(block_hash)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.store

    def __len__(self) -> int:
        return len(self.store)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    # -- engine thread ------------------------------------------------------------------
    def put(self, block_hash: bytes, data: memoryview, digest: int) -> list[bytes] | None:
        """Counts the block in and queues its write; returns the hashes evicted for room
        (their removals queued), or None when it is not kept: larger than the store, or
        the queue is full (dropped, see the module doc). ``data`` must not change after."""
        store, size = self.store, len(data)
        if block_hash in store:
            store.touch(block_hash)
            return []
        if size > store.capacity_bytes:
            return None
        with self._lock:
            if self._queued_bytes and self._queued_bytes + size > self.max_queue_bytes:
                self.stats["dropped"] += 1
                return None
        evicted = store.reserve(block_hash, size)
        assert evicted is not None
        write = _Write(block_hash, data, digest, size)
        with self._cv:
            for old in evicted:
                self._cancel(old)
                self._ops.append(old)
            self._queued_bytes += size
            self._pending[block_hash] = write
            self._unsettled[block_hash] = write
            self._ops.append(write)
            self._cv.notify_all()
        return evicted

    def touch(self, block_hash: bytes) -> None:
        self.store.touch(block_hash)

    def discard(self, block_hash: bytes) -> bool:
        """Forgets a block, cancelling its write if pending, and queues its file's removal;
        False when it was not here."""
        if not self.store.forget(block_hash):
            return False
        with self._cv:
            self._cancel(block_hash)
            self._ops.append(block_hash)
            self._cv.notify_all()
        return True

    def clear(self) -> None:
        """Forgets every block: pending writes cancelled, every file's removal queued."""
        for h in list(self.store.entries):
            self.discard(h)

    def poll(self) -> list[bytes]:
        """The blocks whose writes failed since the last call and are still counted: now
        forgotten (no file was left); the caller announces their removal. Cheap when
        nothing landed."""
        if not self._landed:
            return []
        with self._lock:
            landed, self._landed = self._landed, []
        failed: list[bytes] = []
        for write in landed:
            h = write.block_hash
            if write.cancelled or self._unsettled.get(h) is not write:
                continue
            del self._unsettled[h]
            if not write.ok:
                self.store.forget(h)
                failed.append(h)
        return failed

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until every queued operation is done; False on timeout (tests, close)."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._ops and not self._busy, timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Cancels the writes not started; the writer thread, after the one under way,
        removes the store's files and folder and stops. A writer stuck on a disk that does
        not answer is left (logged): the next store to open the root wipes what is left."""
        if self.store.closed or not self._thread.is_alive():
            return
        with self._cv:
            for h in list(self._pending):
                self._cancel(h)
            self._ops.append(None)
            self._cv.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning(
                "KV disk writer did not stop within %.0f s; %s is left for the next start "
                "to wipe (its blocks are sealed under a key that dies with this process)",
                timeout,
                self.store.path,
            )

    def _cancel(self, block_hash: bytes) -> None:
        """(under the lock) Cancels the block's pending write, if any."""
        write = self._unsettled.pop(block_hash, None)
        if write is None:
            return
        write.cancelled = True
        if self._pending.get(block_hash) is write:
            del self._pending[block_hash]
        if write.state == "queued":
            self._queued_bytes -= write.size
            write.data = None

    # -- any thread ---------------------------------------------------------------------
    def read(
        self,
        block_hash: bytes,
        expected_size: int,
        file_read: Callable[[bytes, int], bytearray | None] | None = None,
    ) -> bytearray | None:
        """The block's verified bytes: from memory while its write is pending, else from
        its file (through ``file_read``, the engine's bounded reads, when given); None if
        either fails a check."""
        with self._lock:
            write = self._pending.get(block_hash)
            data = write.data if write is not None else None
        if write is None or data is None:
            return (file_read or self.store.read)(block_hash, expected_size)
        if len(data) != expected_size or checksum(data) != write.digest:
            return None
        return bytearray(data)

    def read_pending(self, block_hash: bytes, out: Any) -> bool | None:
        """Copies a block whose write is still pending into ``out`` (a writable buffer of
        the block's size), checked against its xxh3-64: True, or False when it fails the
        check; None when no write of it is pending (its file is to be read instead)."""
        with self._lock:
            write = self._pending.get(block_hash)
            data = write.data if write is not None else None
        if write is None or data is None:
            return None
        dst = memoryview(out).cast("B")
        if len(data) != len(dst) or checksum(data) != write.digest:
            return False
        dst[:] = memoryview(data).cast("B")
        return True

    # -- the writer thread ----------------------------------------------------------------
    def _check_folder(self) -> None:
        """(writer thread) Notes, once, that the folder is gone or no longer its own."""
        self._checked_at = time.monotonic()
        if self.lost is None:
            self.lost = self.store.folder_lost()

    def _run(self) -> None:
        while True:
            data: memoryview | None = None
            ok = False
            with self._cv:
                if not self._cv.wait_for(lambda: bool(self._ops), FOLDER_CHECK_S):
                    op: _Write | bytes | None = b""  # idle: only the folder check below
                else:
                    op = self._ops.popleft()
                    if op is None:
                        self._cv.notify_all()
                    elif isinstance(op, _Write):
                        if op.cancelled:
                            self._cv.notify_all()
                            continue
                        op.state = "writing"
                        data = op.data
                    self._busy = op is not None
            if op is None:
                self.store.close()
                return
            if time.monotonic() - self._checked_at >= FOLDER_CHECK_S:
                self._check_folder()
            if isinstance(op, bytes):
                if op:
                    self.store.remove_file(op)
            elif self.lost is None:
                assert data is not None
                ok = self.store.write_file(op.block_hash, data, op.digest)
                if not ok and self.store.last_errno in (errno.ENOENT, errno.ESTALE):
                    self._check_folder()
            with self._cv:
                self._busy = False
                if isinstance(op, _Write):
                    op.state, op.ok, op.data = "done", ok, None
                    self._queued_bytes -= op.size
                    if self._pending.get(op.block_hash) is op:
                        del self._pending[op.block_hash]
                    self.stats["written" if ok else "write_failures"] += 1
                    self._landed.append(op)
                self._cv.notify_all()


@atexit.register
def _close_at_exit() -> None:
    """A process leaving through Python without closing its engine: its disk tiers'
    folders go with it all the same."""
    for writer in list(_LIVE):
        writer.close(timeout=2.0)
