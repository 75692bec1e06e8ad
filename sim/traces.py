"""Request streams for the fleet simulator: real traces and the bounds to judge them by.

Mooncake's traces (``shared/traces/``) give each request its arrival time, its lengths and
one id per 512-token block of the prompt; equal ids at the same position mean an identical
prefix up to and including that block. Replaying one turns every id into a fixed block of
token ids (a PRNG seeded by the id), so every cache, engine and router downstream sees
genuine prefix reuse without the trace ever carrying text.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .workloads import RequestSpec

MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    input_length: int
    output_length: int
    block_ids: tuple[int, ...]  # one per MOONCAKE_BLOCK_TOKENS prompt tokens; last may be partial


def load_mooncake(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Parse a Mooncake jsonl trace; a malformed line is an error naming its line number."""
    out: list[TraceRequest] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
                req = TraceRequest(
                    raw["timestamp"] / 1000.0,
                    int(raw["input_length"]),
                    int(raw["output_length"]),
                    tuple(int(h) for h in raw["hash_ids"]),
                )
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace record ({e})") from None
            blocks_needed = -(-req.input_length // MOONCAKE_BLOCK_TOKENS)
            if req.input_length <= 0 or len(req.block_ids) != blocks_needed:
                raise ValueError(
                    f"{path}:{lineno}: {len(req.block_ids)} block ids for "
                    f"{req.input_length} input tokens"
                )
            out.append(req)
            if limit is not None and len(out) >= limit:
                break
    return out


def block_tokens(block_id: int, vocab_size: int, n: int = MOONCAKE_BLOCK_TOKENS) -> list[int]:
    """The fixed token ids a trace block id stands for (same on every machine)."""
    rng = np.random.Generator(np.random.PCG64(block_id))
    return rng.integers(0, vocab_size, size=n, dtype=np.int64).tolist()


def prompt_tokens(req: TraceRequest, vocab_size: int) -> list[int]:
    """The request's prompt: its blocks' tokens, cut to ``input_length``."""
    tokens: list[int] = []
    for b in req.block_ids:
        tokens.extend(block_tokens(b, vocab_size))
    return tokens[: req.input_length]


def iter_arrivals(
    requests: list[TraceRequest], speed: float = 1.0
) -> Iterator[tuple[float, TraceRequest]]:
    """(arrival time scaled by ``speed``, request), in arrival order."""
    if speed <= 0:
        raise ValueError("speed must be > 0")
    for req in sorted(requests, key=lambda r: r.arrival_s):
        yield req.arrival_s / speed, req


def specs_from_trace(requests: list[TraceRequest], speed: float = 1.0) -> list[RequestSpec]:
    """Mooncake records as specs: one 512-token segment per hash id, the last cut short."""
    out = []
    for t, req in iter_arrivals(requests, speed):
        segs = [(b, MOONCAKE_BLOCK_TOKENS) for b in req.block_ids]
        last = req.input_length - MOONCAKE_BLOCK_TOKENS * (len(segs) - 1)
        segs[-1] = (req.block_ids[-1], last)
        out.append(RequestSpec(t, tuple(segs), max(1, req.output_length)))
    return out
