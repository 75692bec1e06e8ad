"""The disk tier's reads, bounded: no load waits on a disk that does not answer (issue 50).

A disk on a hung network mount blocks a ``read`` forever, and ``O_NONBLOCK`` does nothing
for regular files. Before this, the one loader thread blocked in such a read and every load
behind it, host loads included, waited with it; the requests held their blocks in
``loading`` for good while /health said ok.

So a load is split in two (:class:`DiskFetcher`): its disk blocks are read first, by one of
a few fetch threads, each through :class:`DiskReads` with a deadline; then the job goes to
the loader thread, which only copies and verifies, so host loads never queue behind a disk
read. Jobs are fetched side by side: one hung read holds up its own job only, and another
job whose disk blocks are still in the writer's memory, or whose files answer, lands.

A read that does not answer by its deadline fails its block: the load stops there and the
request recomputes the rest, as after a failed checksum. Its reader thread, stuck in the
system call, is abandoned (nothing can interrupt it) and counted. Readers are made as
needed, at most ``max_readers``; once all of them are stuck, the disk is *unresponsive*:
reads are refused at once and the tiers offer no disk loads (:meth:`.kv_tiers.KVTiers.
lookup`) until a stuck read returns. Each episode logs a warning when it starts, when the
disk is found unresponsive, and when the last stuck read returns.

Invariants:
- ``stuck`` counts the reader threads inside a read whose caller gave up on it, ``<=
  max_readers``; the disk is unresponsive exactly when it equals ``max_readers``;
- a caller waits at most ``deadline_s`` per read, and not at all when unresponsive;
- the fetcher hands every job it takes to the loader, exactly once, whatever its reads did;
  a job waits for a fetch thread at most as long as the jobs ahead of it wait for reads,
  each bounded by the deadline (or not at all once the disk is unresponsive).

Thread-safety: :meth:`DiskReads.read` may be called from any thread (the fetcher, and the
start-up probe); its counters are under its lock. :attr:`DiskReads.unresponsive` is read
by the engine thread without it (a stale answer costs one recompute or one refused read).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvroute.events import MEDIUM_STORAGE

if TYPE_CHECKING:
    from .disk_writer import DiskWriter
    from .tiers import LoadJob

log = logging.getLogger(__name__)

# A read of one block (2 MiB for an 8B model) takes milliseconds from a local disk, well
# under a second from a loaded one; past this it has failed, and its block is recomputed.
READ_DEADLINE_S = 2.0
# Reader threads at most: how many reads may hang before the disk counts as unresponsive.
MAX_READERS = 4


@dataclass(slots=True, eq=False)
class _Read:
    block_hash: bytes
    size: int
    done: threading.Event = field(default_factory=threading.Event)
    result: bytearray | None = None
    started: bool = False
    abandoned: bool = False


class DiskReads:
    """Reads through ``read`` on reader threads, each answered within ``deadline_s``."""

    def __init__(
        self,
        read: Callable[[bytes, int], bytearray | None],
        deadline_s: float = READ_DEADLINE_S,
        max_readers: int = MAX_READERS,
    ) -> None:
        if deadline_s <= 0 or max_readers < 1:
            raise ValueError("a disk read needs a positive deadline and a reader")
        self._read = read
        self.deadline_s = deadline_s
        self.max_readers = max_readers
        self._queue: queue.SimpleQueue[_Read | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0
        self._closed = False
        self.stuck = 0
        self.timeouts = 0
        self.refused = 0  # reads refused at once: the disk was unresponsive
        self._episode_at: float | None = None  # when the first read of this episode hung

    @property
    def unresponsive(self) -> bool:
        return self.stuck >= self.max_readers

    def read(self, block_hash: bytes, size: int) -> bytearray | None:
        """The block's bytes as ``read`` gives them, or None: it gave None, it raised, it
        did not answer within the deadline, or the disk is unresponsive."""
        req = _Read(block_hash, size)
        with self._lock:
            if self._closed or self.unresponsive:
                self.refused += 1
                return None
            if self._idle == 0 and self._threads < self.max_readers:
                self._threads += 1
                threading.Thread(target=self._work, name="kv-disk-reader", daemon=True).start()
            self._queue.put(req)
        if req.done.wait(self.deadline_s):
            return req.result
        with self._lock:
            if req.done.is_set():
                return req.result
            req.abandoned = True
            self.timeouts += 1
            if req.started:
                self.stuck += 1
            first = self._episode_at is None
            if first:
                self._episode_at = time.monotonic()
            stuck, unresponsive = self.stuck, self.unresponsive
        if first:
            log.warning(
                "KV disk tier: a read did not answer within %.1f s; its block is recomputed "
                "(readers stuck: %d of %d)",
                self.deadline_s,
                stuck,
                self.max_readers,
            )
        if unresponsive:
            log.warning(
                "KV disk tier unresponsive: all %d readers stuck; no disk loads until a read "
                "answers",
                self.max_readers,
            )
        return None

    def close(self) -> None:
        """Ends the idle readers (a stuck one ends when its read returns, if ever)."""
        with self._lock:
            self._closed = True
            n = self._threads
        for _ in range(n):
            self._queue.put(None)

    def _work(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            req = self._queue.get()
            with self._lock:
                self._idle -= 1
                if req is None:
                    self._threads -= 1
                    return
                if req.abandoned:  # gave up on before it started
                    continue
                req.started = True
            try:
                result = self._read(req.block_hash, req.size)
            except Exception:  # a bug or an odd file: a miss, never the thread's end
                log.warning("KV disk read failed", exc_info=True)
                result = None
            with self._lock:
                req.result = result
                req.done.set()
                if not req.abandoned:
                    continue
                self.stuck -= 1
                ended = self.stuck == 0 and self._episode_at is not None
                since = self._episode_at or 0.0
                if ended:
                    self._episode_at = None
            if ended:
                log.warning(
                    "KV disk tier answered again after %.1f s (%d reads timed out so far)",
                    time.monotonic() - since,
                    self.timeouts,
                )


class DiskFetcher:
    """The disk half of each load, on fetch threads (as many as ``reads`` has readers):
    reads the job's disk blocks in chain order (from the writer's memory while pending,
    else through ``reads``), stopping at the first that fails, then hands the job on (to
    the loader thread, which copies)."""

    def __init__(
        self,
        disk: DiskWriter,
        reads: DiskReads,
        block_bytes: int,
        handoff: Callable[[LoadJob], None],
    ) -> None:
        self.disk = disk
        self.reads = reads
        self.block_bytes = block_bytes
        self._handoff = handoff
        self._jobs: queue.SimpleQueue[LoadJob | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._run, name="kv-disk-fetch", daemon=True)
            for _ in range(reads.max_readers)
        ]
        for t in self._threads:
            t.start()

    def submit(self, job: LoadJob) -> None:
        self._jobs.put(job)

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)
        self.reads.close()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                for i, (h, medium) in enumerate(zip(job.hashes, job.media, strict=True)):
                    if medium != MEDIUM_STORAGE:
                        continue
                    raw = self.disk.read(h, self.block_bytes, self.reads.read)
                    job.fetched[i] = raw
                    if raw is None:
                        break
            except Exception:  # the loader finds the block missing: the rest is recomputed
                log.warning("KV disk fetch for %s failed", job.request_id, exc_info=True)
            self._handoff(job)
