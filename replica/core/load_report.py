"""A replica's load as routers price it (:class:`~kvroute.events.load.LoadReport`), from
its scheduler's queues and KV cache: one definition, for the engine's scheduler and for the
simulator's replicas, which report through this same function."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kvroute.events.load import LoadReport

from .kv_cache_manager import KVCacheManager


def load_report(waiting: Iterable[Any], running: Sequence[Any], kv: KVCacheManager) -> LoadReport:
    """Load as routers price it: prefill still to compute (waiting requests net of what
    their prefix lookup would hit now, and running prefills' remainder), decode context,
    free blocks. Requests need ``num_tokens``, ``num_computed_tokens`` and
    ``num_output_tokens``: the engine's, and the simulator's, which reports through this
    same function."""
    queued, n_waiting = 0, 0
    for r in waiting:
        queued += r.num_tokens - kv.peek_cached_tokens(r)
        n_waiting += 1
    decoding = context = 0
    for r in running:
        pending = r.num_tokens - r.num_computed_tokens
        if pending <= 1 and r.num_output_tokens:
            decoding += 1
            context += r.num_tokens
        else:
            queued += pending
    return LoadReport(
        num_waiting=n_waiting,
        num_running=len(running),
        num_decoding=decoding,
        queued_prefill_tokens=queued,
        decode_context_tokens=context,
        free_blocks=kv.get_num_free_blocks(),
        total_blocks=kv.block_pool.num_blocks,
    )
