"""What no router can beat on a workload: hit-rate bounds and a throughput ceiling.

- ``ceiling`` hit rate: an infinite cache -- a request hits its leading full blocks that any
  earlier request had (at most ``prompt - 1`` tokens, block-granular, as the engine hits);
- ``pooled`` hit rate: one real :class:`KVCacheManager` of the whole fleet's blocks serving
  the requests one at a time in arrival order (lazy LRU, no concurrency, no output blocks):
  a perfect router over perfectly shared memory; with a host tier, ``pooled_tiered`` is the
  same over the fleet's device and host blocks together (one LRU of both: a perfect router
  over perfectly shared memory of both tiers' size);
- the **throughput ceiling** (:func:`work_ceiling`): the highest arrival rate at which the
  fleet can do even the least work the workload needs. Why: a goodput goal stated as a
  multiple of another policy's ("1.5x the best other") is only reachable if the ceiling is
  that far above the other policy's limit; this says where it is.

The least work assumes everything in a router's favour at once: every request hits the
infinite-cache ceiling, every prompt is prefilled in one chunk, decode steps run as full as
the engine allows (``max_num_seqs`` requests, ``max_num_batched_tokens`` tokens, the KV
cache's tokens of context), and replicas are never idle. On the cost model's roofline a
step lasts ``overhead + max(flops / peak, bytes / bandwidth)``; summed over steps that is
at least ``S * overhead + max(sum flops / peak, (S * weights + sum kv bytes) / bandwidth)``
with ``S`` the fewest steps the batching limits allow -- a bound for one replica, and, as
every term is a sum, for the fleet's summed busy time. The rate that fills every replica's
time with it is ``requests * replicas / seconds``. A finite run can still meet a latency
SLO above it, because the decode work left at the last arrival drains afterwards (on
4,000-request runs: tenants 22% above it, fresh seed 7 15%); no fleet sustains that rate,
which is what a sweep's ``util`` check (:func:`kvroute.sim.goodput._sweep_row`) catches.

With LoRA adapters a second limit can bind first: a step mixes at most ``max_loras``
adapters, so an adapter holds one of its replica's slots while any of its requests runs
there, and the fleet has ``replicas * max_loras`` slots. The **slot ceiling**
(:func:`slot_ceiling`) is the arrival rate at which the slots the workload keeps busy,
expected, reach them all. Each request holds its slot for at least ``output_length`` steps
of the least a step can last (one batch-1 step: the overhead and one read of the weights);
adapter ``a``'s requests arrive at ``lambda_a`` per second; placed on one replica (the
fewest slots: spread over ``k`` replicas it keeps ``k * (1 - exp(-x / k)) >= 1 - exp(-x)``
busy) it keeps a slot busy with probability ``1 - exp(-lambda_a * H_a)`` (M/G/infinity,
``H_a`` its requests' mean hold), and the fleet ``sum_a`` of that. Two assumptions can go
against a router, so it is an estimate, not a bound: each adapter's arrivals are taken as
Poisson (burstier ones share busy periods more), and each request as starting when it
arrives (holding requests back so that more of an adapter's requests share one busy period,
which the TTFT SLO allows up to about one hold, could beat it). Why: on a workload with
many adapters and few slots it, not the work, says how far any policy can go (the ``lora``
workload at Zipf 1.0).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvroute.events import BlockHasher
from kvroute.replica.core.kv_cache_manager import KVCacheManager
from kvroute.replica.model.cost_model import CostModel, Profile

from .workloads import RequestSpec, TokenSource

if TYPE_CHECKING:
    from .simulator import SimConfig


def ceiling_hits(
    specs: Sequence[RequestSpec], hashes: Sequence[Sequence[bytes]], block_size: int
) -> list[int]:
    """Per request, the prompt tokens an infinite cache would hit (see the module docstring)."""
    seen: set[bytes] = set()
    hits = []
    for spec, chain in zip(specs, hashes, strict=True):
        hit = 0
        for h in chain[: (spec.input_length - 1) // block_size]:
            if h not in seen:
                break
            hit += block_size
        hits.append(hit)
        seen.update(chain)
    return hits


def ceiling_hit_rate(
    specs: Sequence[RequestSpec], hashes: Sequence[Sequence[bytes]], block_size: int
) -> float:
    """An infinite cache's hit rate. On Mooncake's traces this is their README's figure up
    to partial last blocks (0.373 vs 0.374 and 0.650 vs 0.651)."""
    total = sum(s.input_length for s in specs)
    return sum(ceiling_hits(specs, hashes, block_size)) / total if total else 0.0


def pooled_hit_rate(
    specs: Sequence[RequestSpec],
    cfg: SimConfig,
    tokens: TokenSource,
    num_blocks: int | None = None,
) -> float:
    """One real KVCacheManager of the fleet's blocks (or ``num_blocks``), serving requests
    one at a time."""
    from .simulator import SimRequest  # the simulator imports this module's callers

    total = hit_tokens = 0
    kv = KVCacheManager(num_blocks or cfg.total_blocks, BlockHasher(block_size=cfg.block_size))
    for i, spec in enumerate(specs):
        n = spec.input_length
        total += n
        toks = array("I")
        toks.frombytes(tokens.prompt_bytes(spec))
        req = SimRequest(
            i, RequestSpec(0.0, spec.segments, 1, spec.cache_salt, spec.lora_name), toks, 0.0
        )
        blocks, hit = kv.get_computed_blocks(req)
        if kv.allocate_slots(req, n - hit, hit, blocks) is not None:
            hit_tokens += hit
        kv.free(req)
    return hit_tokens / total if total else 0.0


def least_work_s(specs: Sequence[RequestSpec], hits: Sequence[int], p: Profile) -> dict[str, float]:
    """The fewest busy seconds one replica of profile ``p`` (or a fleet of them, summed)
    needs for ``specs`` when request ``i`` has ``hits[i]`` prompt tokens cached; with the
    sums it is made of. See the module docstring for why each is a lower bound."""
    dense, attn = 2.0 * p.params, p.attn_flops
    prefill = decode = pairs = kv_tokens = decode_ctx = 0.0
    for spec, h in zip(specs, hits, strict=True):
        n, o = spec.input_length, spec.output_length
        m = n - h  # computed in the prefill; its last position samples the first token
        prefill += m
        pairs += m * h + m * (m - 1) / 2
        kv_tokens += n
        d = max(o - 1, 0)  # each later token is one decode step at positions n .. n + d - 1
        decode += d
        pairs += d * n + d * (d - 1) / 2
        ctx = d * n + d * (d + 1) / 2  # the context a decode step reads, summed
        decode_ctx += ctx
        kv_tokens += ctx
    steps = max(
        decode / p.max_num_seqs,  # a step decodes at most max_num_seqs requests
        (prefill + decode) / p.max_batched_tokens,  # and computes at most this many tokens
        decode_ctx / p.kv_tokens,  # and its batch's context fits in the KV cache
    )
    flops = dense * (prefill + decode) + attn * pairs
    nbytes = steps * p.weight_bytes + p.kv_bytes_per_token * kv_tokens
    compute_s, memory_s = flops / p.peak_flops, nbytes / p.mem_bw
    return {
        "seconds": steps * p.overhead_s + max(compute_s, memory_s),
        "steps": steps,
        "compute_s": compute_s,
        "memory_s": memory_s,
        "overhead_s": steps * p.overhead_s,
        "prefill_tokens": prefill,
        "decode_tokens": decode,
    }


def work_ceiling(
    specs: Sequence[RequestSpec],
    hashes: Sequence[Sequence[bytes]],
    cfg: SimConfig,
) -> dict[str, Any]:
    """The throughput ceiling of ``specs`` on ``cfg``'s fleet, in requests/s and as a speed
    (a multiple of the arrival rate ``specs`` has). A mixed fleet is bounded as if every
    replica were its fastest profile's (loose, but still a bound)."""
    hits = ceiling_hits(specs, hashes, cfg.block_size)
    works = [least_work_s(specs, hits, cfg.profile(i)) for i in range(len(cfg.profiles))]
    work = min(works, key=lambda w: w["seconds"])
    rate = len(specs) * cfg.replicas / work["seconds"] if work["seconds"] > 0 else float("inf")
    span = specs[-1].arrival_s - specs[0].arrival_s if len(specs) > 1 else 0.0
    arrival_rate = len(specs) / span if span > 0 else float("inf")
    bound = "compute" if work["compute_s"] >= work["memory_s"] else "memory"
    return {
        "rate_rps": rate,
        "speed": rate / arrival_rate,
        "least_work_s": work["seconds"],
        "binding": bound,
        "hit_rate": sum(hits) / max(sum(s.input_length for s in specs), 1),
        **{k: work[k] for k in ("steps", "compute_s", "memory_s", "overhead_s")},
    }


def least_step_s(p: Profile) -> float:
    """The least any step of profile ``p`` lasts: its overhead and one read of the weights
    (an empty decode step)."""
    return CostModel(p).coefficients().decode_step_s(0, 0)


def slot_ceiling(specs: Sequence[RequestSpec], cfg: SimConfig) -> dict[str, Any] | None:
    """The LoRA slot ceiling of ``specs`` on ``cfg``'s fleet (module docstring), in
    requests/s and as a speed; None without adapters or slots. ``busy_slots_at_1x``: the
    slots the workload keeps busy, expected, at its own rate; ``rate_rps`` and ``speed`` are
    None when its adapters are too few to fill the slots at any rate."""
    if cfg.lora is None or not cfg.lora.max_loras:
        return None
    span = specs[-1].arrival_s - specs[0].arrival_s if len(specs) > 1 else 0.0
    step = min(least_step_s(cfg.profile(i)) for i in range(cfg.replicas))
    holds: dict[str, list[float]] = {}
    for s in specs:
        if s.lora_name is not None:
            holds.setdefault(s.lora_name, []).append(s.output_length * step)
    if not holds or span <= 0:
        return None
    # lambda_a * H_a at 1x: the adapter's summed hold over the span (count / span * mean)
    load = np.array([sum(h) / span for h in holds.values()])
    slots = cfg.replicas * cfg.lora.max_loras

    def busy(speed: float) -> float:
        return float(np.sum(-np.expm1(-speed * load)))

    speed: float | None = None  # sum_a (1 - exp(.)) < adapters <= slots: never full
    if len(holds) > slots:
        lo, hi = 0.0, 1.0
        while busy(hi) < slots:
            lo, hi = hi, hi * 2.0
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if busy(mid) < slots else (lo, mid)
        speed = hi
    return {
        "rate_rps": None if speed is None else speed * len(specs) / span,
        "speed": speed,
        "slots": slots,
        "adapters": len(holds),
        "busy_slots_at_1x": busy(1.0),
        "hold_s_mean": float(np.mean([h for hs in holds.values() for h in hs])),
        "least_step_s": step,
    }


def describe_slot_ceiling(c: dict[str, Any]) -> str:
    """One line for a :func:`slot_ceiling` result, as the run and sweep reports print it."""
    if c["rate_rps"] is None:
        return f"LoRA slot ceiling: none ({c['adapters']} adapters, {c['slots']} slots)"
    return (
        f"LoRA slot ceiling (an estimate, not a bound: {c['slots']} slots busy, {c['adapters']} "
        f"adapters each on one replica, holds at the least step): {c['rate_rps']:.2f} req/s "
        f"({c['speed']:.3g}x)"
    )


def bounds(
    specs: Sequence[RequestSpec],
    hashes: Sequence[Sequence[bytes]],
    cfg: SimConfig,
    tokens: TokenSource,
) -> dict[str, Any]:
    """The hit-rate bounds and the throughput ceiling of one workload on one fleet."""
    ceiling = work_ceiling(specs, hashes, cfg)
    out = {
        "prompt_tokens": sum(s.input_length for s in specs),
        "ceiling_hit_rate": ceiling["hit_rate"],
        "pooled_hit_rate": pooled_hit_rate(specs, cfg, tokens),
        "throughput_ceiling": ceiling,
    }
    slots = slot_ceiling(specs, cfg)
    if slots is not None:
        out["slot_ceiling"] = slots
    if cfg.has_host_tier:
        host = sum(cfg.host_blocks(i) for i in range(cfg.replicas))
        out["pooled_tiered_hit_rate"] = pooled_hit_rate(specs, cfg, tokens, cfg.total_blocks + host)
    return out
