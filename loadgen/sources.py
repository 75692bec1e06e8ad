"""What ``kvroute bench`` sends: a trace or a built-in workload as request bodies and times.

Why reuse :mod:`kvroute.sim`: the simulator and the load generator then replay the very same
requests -- the same segment ids become the same token blocks (:class:`TokenSource`), so a
hit rate measured on a live fleet can be set beside the simulated one for the same input.
"""

from __future__ import annotations

import zlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvroute.sim.traces import load_mooncake, specs_from_trace
from kvroute.sim.workloads import DEFAULT_VOCAB, RequestSpec, TokenSource, make_workload

PRINTABLE_FIRST, PRINTABLE_LAST = 32, 126  # ' ' .. '~'
_N_PRINTABLE = PRINTABLE_LAST - PRINTABLE_FIRST + 1


@dataclass(frozen=True, slots=True)
class Planned:
    """One request to send: its body, its key, and when (None: as soon as a slot frees)."""

    index: int
    at_s: float | None
    body: dict[str, Any]
    api_key: str | None
    cache_salt: str | None
    prompt_len: int  # tokens as generated (the server's count can differ in text mode)


def load_specs(
    trace: str | None,
    workload: str | None,
    n: int,
    seed: int = 0,
    speed: float = 1.0,
) -> list[RequestSpec]:
    """The first ``n`` requests of a Mooncake trace or of a built-in workload, in order."""
    if speed <= 0:
        raise ValueError("--speed must be > 0")
    if trace:
        return specs_from_trace(load_mooncake(trace, n), speed)
    if workload:
        return make_workload(workload, n, seed, speed)
    raise ValueError("give --trace or --workload")


def scale_lengths(spec: RequestSpec, factor: float, max_tokens: int | None) -> RequestSpec:
    """``spec`` with every prompt segment ``factor`` times as long (at least 1 token; a cut
    segment is a prefix of the full one, so shared prefixes stay shared) and its output cut
    to ``max_tokens``: the workloads' shapes at a size a small model serves."""
    segs = spec.segments
    if factor != 1.0:
        segs = tuple((s, max(1, round(n * factor))) for s, n in segs)
    out = spec.output_length if max_tokens is None else min(spec.output_length, max_tokens)
    return RequestSpec(spec.arrival_s, segs, max(1, out), spec.cache_salt)


def fit_context(spec: RequestSpec, context: int) -> RequestSpec:
    """``spec`` cut to fit a ``context`` of tokens, prompt and output together: the output to
    at most half the context, then the prompt's tail (a cut prompt is a prefix of the full
    one, so shared prefixes stay shared). Unchanged when it fits."""
    prompt = sum(n for _, n in spec.segments)
    if prompt + spec.output_length <= context:
        return spec
    out = max(1, min(spec.output_length, context // 2))
    room = max(1, context - out)
    segs: list[tuple[int, int]] = []
    for seg, n in spec.segments:
        if room <= 0:
            break
        segs.append((seg, min(n, room)))
        room -= n
    return RequestSpec(spec.arrival_s, tuple(segs), out, spec.cache_salt)


def spec_tokens(spec: RequestSpec, source: TokenSource) -> list[int]:
    """The prompt's token ids, exactly as the simulator sees them."""
    return np.frombuffer(source.prompt_bytes(spec), dtype="<u4").tolist()


def tokens_to_text(tokens: Sequence[int]) -> str:
    """One printable ASCII character per token id, deterministically: ids 32-126 are their
    own character (so a byte-level tokenizer such as ``tiny``'s maps the text back 1:1 when
    ids stay in that range), any other id ``32 + id % 95``. Other tokenizers merge or split
    characters: the prefix structure survives, exact token counts do not."""
    return "".join(
        chr(t) if PRINTABLE_FIRST <= t <= PRINTABLE_LAST else chr(32 + t % _N_PRINTABLE)
        for t in tokens
    )


def pick_key(keys: Sequence[str], cache_salt: str | None, index: int) -> str | None:
    """The API key a request is sent with: one per distinct ``cache_salt`` (a stable hash,
    the same on every run and machine), else by request index; None without keys."""
    if not keys:
        return None
    slot = zlib.crc32(cache_salt.encode()) if cache_salt is not None else index
    return keys[slot % len(keys)]


def poisson_times(n: int, rate: float, seed: int) -> list[float]:
    """Arrival times of a Poisson process at ``rate`` per second (seeded)."""
    if rate <= 0:
        raise ValueError("--rate must be > 0")
    rng = np.random.default_rng(seed)
    return np.cumsum(rng.exponential(1.0 / rate, size=n)).tolist()


def plan(
    specs: Sequence[RequestSpec],
    model: str,
    *,
    keys: Sequence[str] = (),
    prompt_format: str = "tokens",
    vocab_size: int = DEFAULT_VOCAB,
    avoid_ids: Collection[int] = (),
    rate: float | None = None,
    closed_loop: bool = False,
    seed: int = 0,
) -> list[Planned]:
    """Request bodies for ``specs``: streamed completions of exactly ``output_length``
    tokens (``ignore_eos``, greedy), sent at the specs' times, at Poisson ``rate``, or
    (``closed_loop``) whenever a slot frees. Token ids are below ``vocab_size``; an id in
    ``avoid_ids`` (a tokenizer's special tokens) becomes the next id that is not."""
    if prompt_format not in ("tokens", "text"):
        raise ValueError(f"unknown prompt format {prompt_format!r}")
    source = TokenSource(vocab_size)
    swap = _swaps(vocab_size, avoid_ids)
    times: list[float | None]
    if closed_loop:
        times = [None] * len(specs)
    elif rate is not None:
        times = list(poisson_times(len(specs), rate, seed))
    else:
        t0 = specs[0].arrival_s if specs else 0.0
        times = [s.arrival_s - t0 for s in specs]
    out = []
    for i, (spec, at) in enumerate(zip(specs, times, strict=True)):
        tokens = spec_tokens(spec, source)
        if swap:
            tokens = [swap.get(t, t) for t in tokens]
        body: dict[str, Any] = {
            "model": model,
            "prompt": tokens if prompt_format == "tokens" else tokens_to_text(tokens),
            "max_tokens": spec.output_length,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if spec.cache_salt is not None:
            body["cache_salt"] = spec.cache_salt
        key = pick_key(keys, spec.cache_salt, i)
        out.append(Planned(i, at, body, key, spec.cache_salt, len(tokens)))
    return out


def _swaps(vocab_size: int, avoid: Collection[int]) -> dict[int, int]:
    """Each avoided id below ``vocab_size`` -> the next id (cyclically) that is not avoided."""
    avoid = {i for i in avoid if 0 <= i < vocab_size}
    if not avoid or len(avoid) >= vocab_size:
        return {}
    out = {}
    for i in avoid:
        j = (i + 1) % vocab_size
        while j in avoid:
            j = (j + 1) % vocab_size
        out[i] = j
    return out
