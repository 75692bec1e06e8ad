"""Decode steps replayed from CUDA graphs: one launch per step instead of ~40 per layer.

Why: a decode step of an 8B model on an H200 costs ~3x its kernels' time (BENCHMARKS.md,
"Engine speed"): Python and kernel launches, not the GPU, bound it. As vLLM does, the
decoder's forward for a decode-only batch is captured once per bucketed batch size (1, 2,
4, 8, then steps of 8) over static input buffers; a step copies its inputs into the
buffers, pads to the bucket and replays. Prefills and mixed steps run eager.

A padded sequence has no new token (``query_start_loc`` stays at the last real token) and
a context of 0; its token rows write no KV (slot -1) and come out as garbage rows that
nothing reads: every op of the decoder is row-wise but attention, which never mixes rows
of different sequences.

Safety: each captured bucket is replayed once at start-up against the eager forward on
the same inputs (their KV written to scratch slots of block 0 on, which hold nothing yet);
if any differs, graphs are turned off with a warning, so a graph that captured something
wrong costs speed, never correctness. ``enforce_eager`` turns them off by hand.

``capture`` is injectable: the tests drive the same buffers, padding and buckets on a CPU
with a capture that calls the function again instead of replaying a graph.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from kvroute.kernels import AttentionMetadata

log = logging.getLogger(__name__)

Forward = Callable[[Tensor, Tensor, AttentionMetadata], Tensor]
Capture = Callable[[Callable[[], Tensor], Any], Callable[[], Tensor]]


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's decode buckets: 1, 2, 4, 8, then every multiple of 8 up to the maximum."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs]
    sizes += list(range(8, max_num_seqs + 8, 8))
    return sorted({min(s, max_num_seqs) for s in sizes})


def cuda_capture(fn: Callable[[], Tensor], pool: Any) -> Callable[[], Tensor]:
    """Captures ``fn`` into a CUDA graph (after a warm-up run on a side stream, as the
    CUDA graph docs require); returns its replay, which returns the static output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()

    def replay() -> Tensor:
        graph.replay()
        return out

    return replay


class DecodeGraphs:
    """Captured decode forwards, one per bucket, sharing static input buffers."""

    def __init__(
        self,
        forward: Forward,
        *,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
        capture: Capture | None = None,
        pool: Any = None,
    ) -> None:
        self.forward = forward
        self.block_size = block_size
        self.buckets = bucket_sizes(max_num_seqs)
        b = self.buckets[-1]
        i32, i64 = torch.int32, torch.long
        self.input_ids = torch.zeros(b, dtype=i64, device=device)
        self.positions = torch.zeros(b, dtype=i64, device=device)
        self.slot_mapping = torch.full((b,), -1, dtype=i64, device=device)
        self.block_tables = torch.zeros((b, max_blocks_per_seq), dtype=i32, device=device)
        self.seq_lens = torch.zeros(b, dtype=i32, device=device)
        self.query_start_loc = torch.zeros(b + 1, dtype=i32, device=device)
        self.max_seq_len = max_blocks_per_seq * block_size
        self._capture = capture or cuda_capture
        self._pool = pool if pool is not None or capture is not None else _graph_pool()
        self.replays: dict[int, Callable[[], Tensor]] = {}

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def bucket(self, n: int) -> int | None:
        """The smallest captured size holding ``n`` sequences (None: too many)."""
        return next((b for b in self.buckets if b >= n), None)

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            max_query_len=1,
            max_seq_len=self.max_seq_len,
            num_decodes=size,
        )

    def capture_all(self) -> float:
        """Captures every bucket, largest first (the shared pool then fits the smaller
        ones); returns the seconds it took."""
        t0 = time.perf_counter()
        for size in reversed(self.buckets):
            self._load_padding(0, size)
            meta = self._meta(size)
            ids, pos = self.input_ids[:size], self.positions[:size]
            self.replays[size] = self._capture(
                lambda i=ids, p=pos, m=meta: self.forward(i, p, m), self._pool
            )
        return time.perf_counter() - t0

    def _load_padding(self, n: int, size: int) -> None:
        """Sequences n..size-1: no token, no context, no KV written."""
        self.slot_mapping[n:size] = -1
        self.seq_lens[n:size] = 0
        self.query_start_loc[n + 1 : size + 1] = n
        self.input_ids[n:size] = 0
        self.positions[n:size] = 0

    def run(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor | None:
        """The hidden states of a decode-only batch, replayed; None where no graph fits (a
        batch past the largest bucket, or a block table wider than the buffers)."""
        n = input_ids.shape[0]
        size = self.bucket(n)
        width = meta.block_tables.shape[1]
        if size is None or size not in self.replays or width > self.block_tables.shape[1]:
            return None
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.query_start_loc[: n + 1].copy_(meta.query_start_loc)
        self._load_padding(n, size)
        return self.replays[size]()[:n]

    def self_check(self, num_blocks: int, atol: float, rtol: float) -> str | None:
        """Each bucket replayed against the eager forward on the same scratch batch (one
        token per sequence at position 0 of block i, blocks that hold nothing yet);
        returns why they differ (None: all agree)."""
        device = self.input_ids.device
        for size in self.buckets:
            if size > num_blocks:
                return f"the cache has fewer than {size} blocks to check with"
            g = torch.Generator().manual_seed(size)
            ids = torch.randint(3, 200, (size,), generator=g).to(device)
            pos = torch.zeros(size, dtype=torch.long, device=device)
            tables = [[i] for i in range(size)]
            meta = AttentionMetadata.build(
                tables, [1] * size, [1] * size, self.block_size, device=device
            )
            eager = self.forward(ids, pos, meta).clone()
            graph = self.run(ids, pos, meta)
            if graph is None:
                return f"no graph ran for a batch of {size}"
            if not torch.allclose(graph.float(), eager.float(), atol=atol, rtol=rtol):
                diff = float((graph.float() - eager.float()).abs().max())
                return f"batch {size}: replay differs from eager by {diff:.3g}"
        return None


def _graph_pool() -> Any:
    return torch.cuda.graph_pool_handle()
