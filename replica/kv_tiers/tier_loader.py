"""The KV tiers' copies between device and host, and the loader thread that uses them.

A mixin of :class:`~.tiers.KVTiers`, split out of :mod:`.tiers` (where the tiers' LRUs,
their events and the engine thread's side live): how a block's bytes leave the device at
eviction (:meth:`TierLoader._copy_out_blocks`, only enqueued on CUDA) and come back
(:meth:`TierLoader._copy_in_blocks`), and the loader thread that seals host copies and runs
each :class:`~.tier_entries.LoadJob`, in chain order a chunk at a time, stopping at the
first block that fails its checks (the invariants are :mod:`.tiers`'s docstring's).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Sequence

import torch

from .disk import checksum
from .tier_entries import HostEntry, LoadJob

log = logging.getLogger(__name__)


# The loader thread's jobs, in the order it takes them: a load waits for no seal queued
# before it (evictions queue one a block, hundreds in a busy step), and a stop drops the
# seals still queued (their entries end with the engine).
LOAD, STOP, SEAL = 0, 1, 2

# A load's chunk on CUDA: blocks staged on the device before one scatter per tensor. The
# staging buffer is kept (this much device memory beside the KV cache, at most).
STAGE_BYTES = 32 << 20


def byte_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a layer's K or V cache, each block's part contiguous) as a uint8 view of one
    row per block: writing a row writes that block's part of ``t``."""
    u = t.view(torch.uint8)
    n = t[0].numel() * t.element_size()
    return u.as_strided((t.shape[0], n), (t.stride(0) * t.element_size(), 1), u.storage_offset())


def device_ids(block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """``block_ids`` on ``device``, copied without holding up the host."""
    ids = torch.tensor(list(block_ids), dtype=torch.long).pin_memory()
    return ids.to(device, non_blocking=True)


def gather_blocks(
    rows: list[torch.Tensor], sizes: list[int], ids: torch.Tensor, out: torch.Tensor
) -> None:
    """Blocks ``ids`` of every ``rows`` (:func:`byte_rows`) into ``out``'s rows, one block a
    row in the tiers' layout (each tensor's part in turn): one kernel a tensor."""
    off = 0
    for r, n in zip(rows, sizes, strict=True):
        torch.index_select(r, 0, ids, out=out[:, off : off + n])
        off += n


def scatter_blocks(
    rows: list[torch.Tensor], sizes: list[int], ids: torch.Tensor, src: torch.Tensor
) -> None:
    """:func:`gather_blocks` undone: ``src``'s rows into blocks ``ids`` of every ``rows``."""
    off = 0
    for r, n in zip(rows, sizes, strict=True):
        r.index_copy_(0, ids, src[:, off : off + n])
        off += n


class TierLoader:
    """:class:`~.tiers.KVTiers`'s copies and loader thread (its attributes)."""

    tensors: list[torch.Tensor]
    sizes: list[int]
    cuda: bool
    device: torch.device
    block_bytes: int
    _rows: list[torch.Tensor]  # byte_rows of each of tensors
    _chunk_blocks: int  # blocks a chunk of a load holds: STAGE_BYTES' worth, at least 1
    _stage: torch.Tensor  # CUDA: [blocks per chunk, block_bytes] on the device; CPU: empty
    _jobs: queue.PriorityQueue[tuple[int, int, LoadJob | HostEntry | None]]
    _done: list[LoadJob]
    _done_lock: threading.Lock
    _wake: threading.Event
    _stream: torch.cuda.Stream | None

    def _copy_out_blocks(
        self, block_ids: list[int]
    ) -> list[tuple[torch.Tensor, torch.cuda.Event | None]]:
        """Each block's bytes in every layer, as one host tensor, and on CUDA the event
        after which they are there (the copies are only enqueued: see the module
        docstring). On CUDA the blocks (a chunk: the caller cuts them) are gathered on the
        device by one kernel per layer's K or V, then each copied out whole (a block's 64
        slices each cost a launch, and evictions come by the hundred when a long prompt is
        admitted)."""
        if not self.cuda:
            return [(torch.cat([r[b] for r in self._rows]), None) for b in block_ids]
        gathered = torch.empty(
            (len(block_ids), self.block_bytes), dtype=torch.uint8, device=self.device
        )
        gather_blocks(self._rows, self.sizes, device_ids(block_ids, self.device), gathered)
        hosts = []
        for row in gathered:
            hosts.append(torch.empty(self.block_bytes, dtype=torch.uint8, pin_memory=True))
            hosts[-1].copy_(row, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return [(host, ready) for host in hosts]

    def _copy_in_blocks(
        self, block_ids: list[int], datas: list[torch.Tensor], rows: list[torch.Tensor]
    ) -> None:
        """Verified blocks into ``rows`` (:func:`byte_rows` of the device cache, or of a
        probe's scratch copy). On CUDA each block crosses the bus as one copy into a
        staging buffer, and one kernel per layer's K or V scatters the batch from there:
        a copy per block and layer (64 of 32 KiB for an 8B model) is bound by launches,
        not the bus (0.85 GB/s where one copy moves 7.8, on an H200)."""
        if not self.cuda:
            for b, d in zip(block_ids, datas, strict=True):
                off = 0
                for r, n in zip(rows, self.sizes, strict=True):
                    r[b].copy_(d[off : off + n])
                    off += n
            return
        stage = self._stage[: len(block_ids)]
        ids = device_ids(block_ids, self.device)
        for j, d in enumerate(datas):
            stage[j].copy_(d, non_blocking=True)
        scatter_blocks(rows, self.sizes, ids, stage)

    def _run(self) -> None:
        """The loader thread: one job at a time, blocks in chain order, stopping at the
        first that fails its checks."""
        while True:
            _, _, job = self._jobs.get()
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
        """The job's blocks in chunks of at most :data:`STAGE_BYTES` (one copy each on
        CUDA: :meth:`_copy_in_blocks`), up to the first that fails its checks."""
        stream = self._stream
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        per_chunk = self._chunk_blocks
        with ctx:
            if stream is not None and job.after is not None:
                stream.wait_event(job.after)
            i, n = 0, len(job.hashes)
            while i < n and job.failed is None:
                datas: list[torch.Tensor] = []
                for j in range(i, min(i + per_chunk, n)):
                    data = self._fetch(job.host_entries[j], job.fetched[j] if job.fetched else None)
                    if data is None:
                        job.failed = job.hashes[j]
                        break
                    datas.append(data)
                if datas:
                    self._copy_in_blocks(job.block_ids[i : i + len(datas)], datas, self._rows)
                if job.fetched:  # copied (on CUDA into pinned memory first): the disk
                    job.fetched[i : i + len(datas)] = [None] * len(datas)  # buffers go back
                i += len(datas)
                job.num_ok = i
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
