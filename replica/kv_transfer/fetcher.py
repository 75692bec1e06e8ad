"""The puller's side: a load whose blocks are on another replica, pulled before the copy.

A request that arrives with a :class:`~kvroute.events.kv_transfer.KVSource` (its prompt
computed elsewhere) loads the part of its prefix that it lacks from that source, as a
lower-tier load whose medium is ``REMOTE`` (:mod:`..core.kv_loads`). Like the disk's
(:class:`~..kv_tiers.disk_reads.DiskFetcher`), a load is split in two: this fetcher's
thread pulls the job's remote blocks into buffers of their own, checking each block's size
and checksum, then hands the job to the tiers' loader thread, which copies them in. So the
engine thread never waits on a socket, and a host load never waits behind a pull.

Whatever happens, exactly one ``done`` goes back to the source per source (the lease is
freed now rather than at its expiry): after the pull, after a pull that failed, or at once
for a request that ended up not pulling (:meth:`RemoteFetcher.release`).

A block that does not arrive, arrives late (past the pull's deadline), short, or with
another checksum ends the load there: what came before it is used, the rest recomputed.

Invariants:
- the fetcher thread touches only the job in hand (``fetched`` of its REMOTE blocks) and
  the link; it hands every job it takes to the loader exactly once;
- a job's REMOTE blocks are a suffix of it, in chain order, at lease positions
  ``job.start + i`` (the chain position of the job's block ``i``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from kvroute.events import MEDIUM_STORAGE
from kvroute.events.kv_transfer import MEDIUM_REMOTE, PULL_OK, KVSource

from ..kv_tiers.disk import checksum
from .sender import BlockSink

if TYPE_CHECKING:
    from ..kv_tiers.tiers import LoadJob

log = logging.getLogger(__name__)

# A pull's deadline: this long, plus the time its bytes take at the link's measured speed
# (thrice, for a busy source), past which the rest is recomputed.
PULL_BASE_DEADLINE_S = 1.0


class KVLink(Protocol):
    """How a puller reaches sources: in process (:class:`~.sender.LocalLink`) or over the
    transfer plane (:class:`~.plane.PlaneLink`)."""

    def pull(
        self,
        source: KVSource,
        start: int,
        hashes: Sequence[bytes],
        sink: BlockSink,
        deadline_s: float,
    ) -> tuple[int, str]: ...

    def keep(self, source: KVSource, extend_s: float) -> None: ...

    def done(self, source: KVSource) -> None: ...


def durable_blocks(link: KVLink) -> bool:
    """Whether ``link`` hands its sink bytes that stay valid after the call (a received
    frame of its own: kept as is), rather than a buffer it reuses (copied out)."""
    return bool(getattr(link, "durable_blocks", False))


class RemoteFetcher:
    """Pulls the REMOTE blocks of each load, on one thread, then hands the job on."""

    def __init__(
        self,
        link: KVLink,
        block_bytes: int,
        hand: Callable[[LoadJob], None],
        bytes_per_s: float = 0.0,
    ) -> None:
        self.link = link
        self.block_bytes = block_bytes
        self._hand = hand
        self.bytes_per_s = bytes_per_s  # measured pulls, a running mean (0: none yet)
        self.stats = {"pulls": 0, "blocks": 0, "failures": 0, "released_unused": 0}
        self._jobs: queue.SimpleQueue[LoadJob | KVSource | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvr-kvrecv", daemon=True)
        self._thread.start()

    def submit(self, job: LoadJob) -> None:
        self._jobs.put(job)

    def release(self, source: KVSource) -> None:
        """A request that will not pull from ``source`` after all: free its lease there."""
        self.stats["released_unused"] += 1
        self._jobs.put(source)

    def close(self) -> None:
        self._jobs.put(None)

    def deadline(self, nbytes: int) -> float:
        rate = self.bytes_per_s
        return PULL_BASE_DEADLINE_S + (3.0 * nbytes / rate if rate > 0 else 0.0)

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            if isinstance(item, KVSource):
                self._done(item)
                continue
            source, item.source = item.source, None
            if source is not None:
                try:
                    self._pull(item, source)
                except Exception:  # the loader finds the blocks missing: recomputed
                    log.warning("KV pull for %s failed", item.request_id, exc_info=True)
                finally:
                    self._done(source)
            self._hand(item)

    def _done(self, source: KVSource) -> None:
        if not source.lease:  # a prefix fetch: the source ended its pin with the pull
            return
        try:
            self.link.done(source)
        except Exception:  # the lease expires at the source instead
            log.warning("KV lease release to %s failed", source.replica_id, exc_info=True)

    def _pull(self, job: LoadJob, source: KVSource) -> None:
        first = next((i for i, m in enumerate(job.media) if m == MEDIUM_REMOTE), len(job.media))
        if first == len(job.media):
            return
        if any(job.media[i] == MEDIUM_STORAGE and job.fetched[i] is None for i in range(first)):
            return  # a disk block before them failed: the load stops there; pull nothing
        hashes = job.hashes[first:]
        size = self.block_bytes
        got = 0
        failed = False
        keep = durable_blocks(self.link)

        def sink(i: int, data: memoryview, digest: int) -> bool:
            nonlocal got, failed
            if i != got or len(data) != size or checksum(data) != digest:
                failed = True
                return False
            job.fetched[first + i] = data if keep else bytearray(data)
            got += 1
            return True

        t0 = time.perf_counter()
        self.stats["pulls"] += 1
        _, reason = self.link.pull(
            source, job.start + first, hashes, sink, self.deadline(len(hashes) * size)
        )
        seconds = time.perf_counter() - t0
        self.stats["blocks"] += got
        if failed or reason != PULL_OK or got < len(hashes):
            self.stats["failures"] += 1
            log.info(
                "KV pull for %s from %s: %d of %d blocks (%s)",
                job.request_id,
                source.replica_id,
                got,
                len(hashes),
                "checksum or size" if failed else reason,
            )
        if got and seconds > 0:
            rate = got * size / seconds
            old = self.bytes_per_s
            self.bytes_per_s = rate if old == 0 else old + 0.2 * (rate - old)
