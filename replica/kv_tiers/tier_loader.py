"""The KV tiers' copies between device and host, and the loader thread that uses them.

A mixin of :class:`~.tiers.KVTiers`, split out of :mod:`.tiers` (where the tiers' LRUs,
their events and the engine thread's side live): how a block's bytes leave the device at
eviction (:meth:`TierLoader._copy_out`, only enqueued on CUDA) and come back
(:meth:`TierLoader._copy_in`), and the loader thread that seals host copies and runs each
:class:`~.tier_entries.LoadJob`, block by block in chain order, stopping at the first that
fails its checks (the invariants are :mod:`.tiers`'s docstring's).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time

import torch

from .disk import checksum
from .tier_entries import HostEntry, LoadJob

log = logging.getLogger(__name__)


class TierLoader:
    """:class:`~.tiers.KVTiers`'s copies and loader thread (its attributes)."""

    tensors: list[torch.Tensor]
    sizes: list[int]
    cuda: bool
    block_bytes: int
    _jobs: queue.SimpleQueue[LoadJob | HostEntry | None]
    _done: list[LoadJob]
    _done_lock: threading.Lock
    _wake: threading.Event
    _stream: torch.cuda.Stream | None

    def _copy_out(self, block_id: int) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """The block's bytes in every layer, as one host tensor, and on CUDA the event after
        which they are there (the copy is only enqueued: see the module docstring)."""
        parts = [t[block_id].reshape(-1).view(torch.uint8) for t in self.tensors]
        out = torch.cat(parts)
        if not self.cuda:
            return out, None
        host = torch.empty(out.numel(), dtype=torch.uint8, pin_memory=True)
        host.copy_(out, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return host, ready

    def _copy_in(self, block_id: int, data: torch.Tensor) -> None:
        off = 0
        for t, n in zip(self.tensors, self.sizes, strict=True):
            dst = t[block_id].reshape(-1).view(torch.uint8)
            dst.copy_(data[off : off + n], non_blocking=self.cuda)
            off += n

    def _run(self) -> None:
        """The loader thread: one job at a time, blocks in chain order, stopping at the
        first that fails its checks."""
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if isinstance(job, HostEntry):
                try:
                    job.seal()
                except Exception:  # the load that needs it seals it again, or fails it
                    log.warning("KV tier copy-out could not be checksummed", exc_info=True)
                continue
            t0 = time.perf_counter()
            try:
                self._load(job)
            except Exception:  # never the engine's death: the rest is recomputed
                log.warning("KV tier load for %s failed", job.request_id, exc_info=True)
                if job.failed is None and job.num_ok < len(job.hashes):
                    job.failed = job.hashes[job.num_ok]
            job.seconds = time.perf_counter() - t0
            job.done.set()
            with self._done_lock:
                self._done.append(job)
                self._wake.set()

    def _load(self, job: LoadJob) -> None:
        stream = self._stream
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with ctx:
            if stream is not None and job.after is not None:
                stream.wait_event(job.after)
            for i, (h, entry) in enumerate(zip(job.hashes, job.host_entries, strict=True)):
                data = self._fetch(entry, job.fetched[i] if job.fetched else None)
                if data is None:
                    job.failed = h
                    break
                self._copy_in(job.block_ids[i], data)
                if job.fetched:  # copied (on CUDA into pinned memory first): the disk
                    job.fetched[i] = None  # fetcher's buffer goes back for reuse
                job.num_ok = i + 1
        if stream is not None:
            stream.synchronize()  # the blocks are in before the job says so

    def _fetch(
        self, entry: HostEntry | None, raw: bytearray | memoryview | None
    ) -> torch.Tensor | None:
        """A block's verified bytes from its host entry, or the disk's as the fetcher read
        them (verified there); None if they fail a check or were not read."""
        if entry is not None:
            data = entry.data
            if data.numel() != self.block_bytes or checksum(data.numpy()) != entry.seal():
                return None
            if self.cuda and not data.is_pinned():
                data = data.pin_memory()
            return data
        if raw is None or len(raw) != self.block_bytes:
            return None
        data = torch.frombuffer(raw, dtype=torch.uint8)  # the fetcher's own buffer
        return data.pin_memory() if self.cuda else data
