"""The source's side of a pull: leased blocks read out of the KV cache, each with its
checksum, for whoever holds the lease.

:class:`KVSender` is the transport-free core: it checks a pull against the lease, copies
each block's bytes (every layer's K and V, in the tiers' layout: :class:`BlockReader`) and
hands them to a sink with their xxh3-64. The transfer plane serves it over ZeroMQ
(:mod:`.plane`); :class:`LocalLink` calls it in process (two engines in one process: tests,
and the simulator's exactness checks).

Why reading off the engine thread is safe: see :mod:`.leases` (a leased block is never
rewritten; a lease being read is never ended). On CUDA the copy runs on this thread's own
stream and is waited for before its checksum.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvroute.events.kv_transfer import PULL_FAILED, PULL_OK, PULL_UNKNOWN, KVSource

from ..kv_tiers.disk import checksum
from ..kv_tiers.tier_loader import STAGE_BYTES, byte_rows, device_ids, gather_blocks
from .leases import Leases

# A sink takes (index in the pull, the block's bytes, their xxh3-64) and says whether to go
# on. The bytes are valid only during the call (the reader reuses its buffer), unless the
# pull was served with ``buffers``.
BlockSink = Callable[[int, memoryview, int], bool]

# How long a fetch waits for the engine thread to pin the blocks it names (one poll: a step,
# or an idle engine's wake-up). Past it the pull is refused and the puller recomputes.
PIN_WAIT_S = 2.0


class BlockReader:
    """Copies blocks of every layer's K and V into host buffers, one a block."""

    def __init__(self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.tensors = [t for kv in kv_caches for t in kv]
        self.sizes = [t[0].numel() * t.element_size() for t in self.tensors]
        self.block_bytes = sum(self.sizes)
        device = self.tensors[0].device
        self.cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self.cuda else None
        # Blocks read at once: on CUDA one kernel per layer's K or V gathers them into a
        # device buffer kept for it, and each block leaves in one copy (a copy per block
        # and layer is bound by launches, as the tiers' loads are: kv_tiers.tier_loader).
        self.chunk_blocks = max(1, STAGE_BYTES // self.block_bytes) if self.cuda else 1
        self._rows = [byte_rows(t) for t in self.tensors] if self.cuda else []
        self._stage = (
            torch.empty((self.chunk_blocks, self.block_bytes), dtype=torch.uint8, device=device)
            if self.cuda
            else None
        )
        # On the CPU, each tensor's bytes as one flat view: a block's copy is then a slice
        # assignment per tensor (about a microsecond) where a torch copy_ costs several.
        self._flat: list[memoryview] | None = None
        if not self.cuda and all(t.is_contiguous() for t in self.tensors):
            self._flat = [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in self.tensors]

    def buffer(self) -> torch.Tensor:
        """A host buffer for one block (pinned on CUDA): one per reading thread."""
        return torch.empty(self.block_bytes, dtype=torch.uint8, pin_memory=self.cuda)

    def read_many(self, block_ids: Sequence[int], outs: Sequence[torch.Tensor]) -> None:
        """Blocks ``block_ids`` into ``outs`` (one :meth:`buffer` each), at most
        :attr:`chunk_blocks` at a time; returns once they are all there."""
        if self._stream is None or self._stage is None:
            for block_id, out in zip(block_ids, outs, strict=True):
                self._read_one(block_id, out)
            return
        stage = self._stage[: len(block_ids)]
        with torch.cuda.stream(self._stream):
            gather_blocks(self._rows, self.sizes, device_ids(block_ids, stage.device), stage)
            for row, out in zip(stage, outs, strict=True):
                out.copy_(row, non_blocking=True)
        self._stream.synchronize()

    def _read_one(self, block_id: int, out: torch.Tensor) -> None:
        """One block on the CPU (CUDA reads go a chunk at a time: :meth:`read_many`)."""
        off = 0
        if self._flat is not None:
            dst = memoryview(out.numpy())
            for src, n in zip(self._flat, self.sizes, strict=True):
                dst[off : off + n] = src[block_id * n : (block_id + 1) * n]
                off += n
            return
        for t, n in zip(self.tensors, self.sizes, strict=True):
            out[off : off + n].copy_(t[block_id].reshape(-1).view(torch.uint8))
            off += n


class KVSender:
    """Serves pulls of one engine's leased blocks (any thread; one buffer per call)."""

    def __init__(self, leases: Leases, reader: BlockReader, replica_id: str) -> None:
        self.leases = leases
        self.reader = reader
        self.replica_id = replica_id
        self.endpoint = ""  # set once a transfer plane serves it
        keys = ("pulls", "fetches", "blocks_sent", "bytes_sent", "pulls_refused")
        self.stats = dict.fromkeys(keys, 0)

    def serve(
        self,
        lease: bytes,
        start: int,
        hashes: Sequence[bytes],
        sink: BlockSink,
        buffers: Callable[[], torch.Tensor] | None = None,
    ) -> tuple[int, str]:
        """Sends the lease's blocks ``hashes`` (from position ``start``) to ``sink`` in
        order; (blocks sent, why it ended: ``PULL_OK`` or a refusal's reason). ``buffers``:
        each block read into the next buffer it gives (of ``reader.buffer()``'s size and
        kind), which the sink may keep (a zero-copy send); None: one buffer, reused.
        An empty ``lease`` is a prefix fetch: the blocks of ``hashes`` the cache holds now,
        from the first, pinned for the pull (:meth:`Leases.pin`)."""
        pinned = b""
        if not lease:  # a prefix fetch: what the cache holds of them, leased for this pull
            got = self.leases.pin(hashes, PIN_WAIT_S)
            if got is None:
                self.stats["pulls_refused"] += 1
                return 0, PULL_UNKNOWN
            lease = pinned = got.lease_id
            start, hashes = 0, got.hashes
            self.stats["fetches"] += 1
        ids = self.leases.open(lease, start, hashes)
        if isinstance(ids, str):
            self.stats["pulls_refused"] += 1
            if pinned:
                self.leases.release(pinned)
            return 0, ids
        self.stats["pulls"] += 1
        sent = 0
        reader = self.reader
        try:
            fresh = buffers or reader.buffer
            per_chunk = min(reader.chunk_blocks, len(ids))
            reused = [] if buffers is not None else [fresh() for _ in range(per_chunk)]
            stop = False
            for first in range(0, len(ids), reader.chunk_blocks):
                chunk = ids[first : first + reader.chunk_blocks]
                bufs = reused[: len(chunk)] if reused else [fresh() for _ in chunk]
                try:
                    reader.read_many(chunk, bufs)
                except Exception:
                    return sent, PULL_FAILED
                for buf in bufs:
                    view = memoryview(buf.numpy())
                    if not sink(sent, view, checksum(view)):
                        stop = True
                        break
                    sent += 1
                if stop:
                    break
            self.stats["blocks_sent"] += sent
            self.stats["bytes_sent"] += sent * self.reader.block_bytes
            return sent, PULL_OK
        finally:
            self.leases.close(lease)
            if pinned:
                self.leases.release(pinned)

    def keep(self, lease: bytes, extend_s: float) -> bool:
        return self.leases.keep(lease, extend_s)

    def done(self, lease: bytes) -> None:
        self.leases.release(lease)


class LocalLink:
    """A link to senders in this process, by replica id: the puller's side of a pull
    without a socket (see :class:`~.fetcher.KVLink`)."""

    def __init__(self, senders: dict[str, KVSender] | None = None) -> None:
        self.senders: dict[str, KVSender] = dict(senders or {})

    def pull(
        self,
        source: KVSource,
        start: int,
        hashes: Sequence[bytes],
        sink: BlockSink,
        deadline_s: float,
    ) -> tuple[int, str]:
        sender = self.senders.get(source.replica_id)
        if sender is None:
            return 0, "unreachable"
        return sender.serve(source.lease, start, hashes, sink)

    def keep(self, source: KVSource, extend_s: float) -> None:
        sender = self.senders.get(source.replica_id)
        if sender is not None:
            sender.keep(source.lease, extend_s)

    def done(self, source: KVSource) -> None:
        sender = self.senders.get(source.replica_id)
        if sender is not None:
            sender.done(source.lease)
