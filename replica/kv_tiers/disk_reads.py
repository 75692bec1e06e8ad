"""The disk tier's reads, bounded: no load waits on a disk that does not answer (issue 50).

A disk on a hung network mount blocks a ``read`` forever, and ``O_NONBLOCK`` does nothing
for regular files. Before this, the one loader thread blocked in such a read and every load
behind it, host loads included, waited with it; the requests held their blocks in
``loading`` for good while /health said ok.

So a load is split in two (:class:`DiskFetcher`): its disk blocks are read first, by one of
a few fetch threads, each read on a reader thread of :class:`DiskReads` with a deadline;
then the job goes to the loader thread, which only copies and verifies, so host loads never
queue behind a disk read. Jobs are fetched side by side: one hung read holds up its own job
only, and another job whose disk blocks are still in the writer's memory, or whose files
answer, lands.

A read that does not answer by its deadline fails its block: the load stops there and the
request recomputes the rest, as after a failed checksum. Its reader thread, stuck in the
system call, is abandoned (nothing can interrupt it) and counted. Readers are made as
needed, at most ``max_readers``; once all of them are stuck, the disk is *unresponsive*:
reads are refused at once and the tiers offer no disk loads (:meth:`.kv_tiers.KVTiers.
lookup`) until a stuck read returns. Each episode logs a warning when it starts, when the
disk is found unresponsive, and when the last stuck read returns.

Pipelined (issue 50: sealing's cost): a fetch thread reads a job's blocks ahead of the one
it verifies. Opening a sealed block (AES-GCM, ~220 us for 2 MiB) holds the GIL; a file read
releases it. So while the fetch thread opens block ``i`` (or checks a plain one's xxh3),
the reads of the next ``READ_AHEAD`` blocks are under way on reader threads, and a run of
blocks costs about its reads or its opens, whichever is more, instead of both: where the
reads wait on the disk, or a core is free for them (a read from the page cache is a copy
on a CPU; on a host with no free core the two still take turns). Before it opens a block,
the fetch thread waits (briefly) until the read it just submitted is inside its system
call: a reader that still needed the GIL to get there would otherwise wait out the whole
open, and the two would run in turn.

Copies: the fetcher reads each file's body straight into a buffer, 64-byte aligned like the
body in the file (``disk.HEADER_BYTES``): a plain block's payload into the very buffer
handed to the loader; a sealed one's into a buffer of the fetch thread's, reused, which it
then opens straight into the buffer handed to the loader. Those come back for reuse once
the loader let go of them (:class:`BlockBuffers`: fresh memory would cost its page faults
on every load). So a block is copied once on its way to the loader (the read), sealed
twice (the read, the open).

Invariants:
- ``stuck`` counts the reader threads inside a read whose caller gave up on it (its
  deadline passed), ``<= max_readers``; the disk is unresponsive exactly when it equals
  ``max_readers``;
- a caller waits for a read at most ``deadline_s`` from its submission, and not at all
  when the disk is unresponsive; a read it no longer needs (:meth:`DiskReads.drain`) is
  dropped if not started, else waited for like any other (so ``stuck`` stays true);
- the fetcher hands every job it takes to the loader, exactly once, whatever its reads did,
  with ``fetched`` holding a leading run of its disk blocks, verified (those after the
  first that failed stay None); a job waits for a fetch thread at most as long as the jobs
  ahead of it wait for reads, each bounded by the deadline (or not at all once the disk is
  unresponsive);
- a fetch thread has at most ``READ_AHEAD + 1`` reads in flight, all of its job in hand;
  a buffer a read was given is reused only after that read returned (or was dropped
  unstarted): one whose read was abandoned is dropped (the stuck reader may still write
  into it), never handed on; a buffer whose bytes failed their check is never handed on;
- memory kept for reuse: at most ``KEEP_BYTES`` of block buffers, and ``READ_AHEAD + 1``
  sealed bodies per fetch thread.

Thread-safety: :meth:`DiskReads.submit`, :meth:`DiskReads.result`, :meth:`DiskReads.drain`
and :meth:`DiskReads.read` may be called from any thread (the fetch threads, and the
start-up probe); the counters are under its lock. :attr:`DiskReads.unresponsive` is read
by the engine thread without it (a stale answer costs one recompute or one refused read).
Each fetch thread owns its job in hand and its spare buffers; a reader thread touches only
the file it reads and the buffer its read was given.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvroute.events import MEDIUM_STORAGE

from .disk import aligned_empty

if TYPE_CHECKING:
    from .disk_writer import DiskWriter
    from .tiers import LoadJob

log = logging.getLogger(__name__)

# A read of one block (2 MiB for an 8B model) takes milliseconds from a local disk, well
# under a second from a loaded one; past this it has failed, and its block is recomputed.
READ_DEADLINE_S = 2.0
# Reader threads at most: how many reads may hang before the disk counts as unresponsive.
MAX_READERS = 4
# Reads a fetch thread keeps under way beyond the block it is verifying. One hides an open
# (or a checksum) behind the next read; more only adds reads to wait on, and a hung disk
# would then take more readers down with one job.
READ_AHEAD = 1
# How long a fetch thread waits for a read it just submitted to reach its system call
# before it opens a block anyway (a reader picks a read up in tens of microseconds).
HANDOFF_S = 0.002
# Buffers kept for reuse (:class:`BlockBuffers`): a run of 16 blocks of an 8B model.
KEEP_BYTES = 32 << 20


@dataclass(slots=True, eq=False)
class _Read:
    call: Callable[..., Any]
    args: tuple[Any, ...]
    at: float  # time.monotonic() at submission: its deadline runs from here
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    started: bool = False
    abandoned: bool = False
    prompt: bool = False  # a reader was free for it when it was submitted


class DiskReads:
    """Runs reads (``read``, or another call per read) on reader threads, each answered
    within ``deadline_s`` of its submission."""

    def __init__(
        self,
        read: Callable[..., Any],
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
        self._queued = 0  # submitted, not yet taken by a reader
        self._closed = False
        self.stuck = 0
        self.timeouts = 0
        self.refused = 0  # reads refused at once: the disk was unresponsive
        self._episode_at: float | None = None  # when the first read of this episode hung

    @property
    def unresponsive(self) -> bool:
        return self.stuck >= self.max_readers

    def read(self, *args: Any) -> Any:
        """``read(*args)`` as it returns, or None: it gave None, it raised, it did not
        answer within the deadline, or the disk is unresponsive."""
        return self.result(self.submit(*args))

    def submit(self, *args: Any, call: Callable[..., Any] | None = None) -> _Read:
        """Starts ``call(*args)`` (``read`` by default) on a reader thread; its answer is
        :meth:`result`'s. Refused at once (its result None) when the disk is unresponsive."""
        req = _Read(call or self._read, args, time.monotonic())
        with self._lock:
            if self._closed or self.unresponsive:
                self.refused += 1
                req.done.set()
                return req
            self._queued += 1
            if self._queued > self._idle and self._threads < self.max_readers:
                self._threads += 1
                self._idle += 1  # counted before it runs, so the next submit sees it
                threading.Thread(target=self._work, name="kv-disk-reader", daemon=True).start()
            req.prompt = self._queued <= self._idle
            self._queue.put(req)
        return req

    def result(self, req: _Read) -> Any:
        """The read's answer, waiting at most until ``deadline_s`` after its submission; None
        past that (the read is abandoned, its reader counted stuck if it had started)."""
        if req.done.wait(max(0.0, req.at + self.deadline_s - time.monotonic())):
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

    def drain(self, req: _Read) -> bool:
        """A read whose answer is no longer needed: dropped if no reader took it yet, else
        waited for as :meth:`result` does. True once no reader will touch what it was given
        (it returned, or never started); False when it was abandoned while running."""
        with self._lock:
            if not req.started and not req.done.is_set():
                req.abandoned = True
                return True
        self.result(req)
        return req.done.is_set()

    def close(self) -> None:
        """Ends the idle readers (a stuck one ends when its read returns, if ever)."""
        with self._lock:
            self._closed = True
            n = self._threads
        for _ in range(n):
            self._queue.put(None)

    def _work(self) -> None:
        counted = True  # submit counted this thread idle before it started
        while True:
            if not counted:
                with self._lock:
                    self._idle += 1
            counted = False
            req = self._queue.get()
            with self._lock:
                self._idle -= 1
                if req is None:
                    self._threads -= 1
                    return
                self._queued -= 1
                if req.abandoned:  # given up on before it started
                    continue
                req.started = True
            try:
                result = req.call(*req.args)
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


@dataclass(slots=True, eq=False)
class _Block:
    """One of a job's disk blocks on its way: from the writer's memory (``ok`` already
    known) or from its file (``read`` under way into ``body``)."""

    index: int
    out: np.ndarray  # what the loader gets: the block's bytes, once verified
    ok: bool | None = None  # from memory: its check's answer
    read: _Read | None = None
    body: np.ndarray | None = None  # what the file's body is read into (``out`` if plain)
    went: threading.Event | None = None  # its reader is in the read's system call, or done


class BlockBuffers:
    """Buffers of one size, reused: what a job's disk blocks are handed to the loader in.

    Why: a fresh 2 MiB buffer costs its page faults on first touch, about 1 ms here (a VM),
    more than the read that fills it; and a freed run of them goes back to the OS (malloc
    trims), so the next load faults again. Each buffer is handed out as a view of one kept
    here; when the view is collected (the loader copied it, and nothing refers to it), its
    memory comes back for the next block. At most ``keep_bytes`` of them are kept.

    Thread-safety: :meth:`take` on any thread; a buffer comes back on whichever thread drops
    the last reference to its view (a ``deque``: no lock, so a collection anywhere cannot
    deadlock on one). Memory a stuck read still holds never comes back (its view lives)."""

    def __init__(self, size: int, keep_bytes: int) -> None:
        self.size = size
        self.keep = max(2, keep_bytes // max(size, 1))
        self._free: deque[np.ndarray] = deque()

    def take(self) -> np.ndarray:
        try:
            base = self._free.pop()
        except IndexError:
            base = aligned_empty(self.size)  # filled whole before use: no zeroing
        view = base[:]
        weakref.finalize(view, self._give, base)
        return view

    def _give(self, base: np.ndarray) -> None:
        if len(self._free) < self.keep:
            self._free.append(base)

    def __len__(self) -> int:
        return len(self._free)


class DiskFetcher:
    """The disk half of each load, on fetch threads (as many as ``reads`` has readers):
    reads the job's disk blocks in chain order (from the writer's memory while pending,
    else from their files through ``reads``, up to ``ahead`` blocks ahead of the one being
    verified), stopping at the first that fails, then hands the job on (to the loader
    thread, which copies). ``alloc()`` gives the buffer each block is handed on in (a
    writable buffer of ``block_bytes``, filled whole before it is handed on): by default
    one of ``buffers``, reused once the loader is done with it."""

    def __init__(
        self,
        disk: DiskWriter,
        reads: DiskReads,
        block_bytes: int,
        handoff: Callable[[LoadJob], None],
        *,
        ahead: int = READ_AHEAD,
        alloc: Callable[[], np.ndarray] | None = None,
    ) -> None:
        if ahead < 0:
            raise ValueError("read-ahead must be >= 0")
        self.disk = disk
        self.reads = reads
        self.block_bytes = block_bytes
        self.ahead = ahead
        self.buffers = BlockBuffers(block_bytes, KEEP_BYTES)
        self._alloc = alloc or self.buffers.take
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
        spare: list[np.ndarray] = []  # this thread's bodies for sealed reads, reused
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._fetch(job, spare)
            except Exception:  # the loader finds the block missing: the rest is recomputed
                log.warning("KV disk fetch for %s failed", job.request_id, exc_info=True)
            self._handoff(job)
            job = None  # its buffers come back once the loader is done with them

    def _read_file(
        self, block_hash: bytes, size: int, body: np.ndarray, went: threading.Event
    ) -> bytes | None:
        """(a reader thread) The file's header, its body read into ``body``."""
        try:
            return self.disk.store.read_file(block_hash, size, memoryview(body), went.set)
        finally:
            went.set()

    def _begin(self, job: LoadJob, i: int, spare: list[np.ndarray]) -> _Block:
        """Starts getting block ``i`` of ``job``: copied now if its write is pending, else
        its file's read submitted."""
        h, size = job.hashes[i], self.block_bytes
        block = _Block(i, self._alloc())
        block.ok = self.disk.read_pending(h, block.out)
        if block.ok is not None:
            return block
        store = self.disk.store
        if store.encrypted:
            n = store.body_bytes(size)
            block.body = spare.pop() if spare else aligned_empty(n)
        else:
            block.body = block.out  # the payload lands where the loader reads it
        block.went = threading.Event()
        block.read = self.reads.submit(h, size, block.body, block.went, call=self._read_file)
        return block

    def _fetch(self, job: LoadJob, spare: list[np.ndarray]) -> None:
        store, size = self.disk.store, self.block_bytes
        todo = deque(i for i, m in enumerate(job.media) if m == MEDIUM_STORAGE)
        flight: deque[_Block] = deque()
        try:
            while todo or flight:
                while todo and len(flight) <= self.ahead:  # this one and ``ahead`` more
                    flight.append(self._begin(job, todo.popleft(), spare))
                block = flight.popleft()
                ok = block.ok
                if block.read is not None:
                    header = self.reads.result(block.read)
                    if header is None:
                        if block.read.done.is_set() and store.encrypted:
                            spare.append(block.body)  # type: ignore[arg-type]
                        break  # missing, refused, or past its deadline (the body is lost)
                    self._let_reads_start(flight)  # the next ``ahead``, read while it opens
                    h = job.hashes[block.index]
                    ok = store.open_body(h, size, header, memoryview(block.body), block.out)
                    if store.encrypted:
                        spare.append(block.body)  # type: ignore[arg-type]
                if not ok:
                    break
                job.fetched[block.index] = block.out
        finally:
            for left in flight:  # reads past the block that stopped the load
                if left.read is not None and self.reads.drain(left.read) and store.encrypted:
                    spare.append(left.body)  # type: ignore[arg-type]
            del spare[self.ahead + 1 :]

    def _let_reads_start(self, flight: deque[_Block]) -> None:
        """Waits (at most ``HANDOFF_S`` in all) until each read under way that a reader is
        free to take is inside its system call: opening a block holds the GIL, and a reader
        that needed it first would wait out the open instead of reading beside it."""
        until = time.monotonic() + HANDOFF_S
        for block in flight:
            if block.went is None or block.read is None or not block.read.prompt:
                continue
            left = until - time.monotonic()
            if left <= 0 or not block.went.wait(left):
                return
