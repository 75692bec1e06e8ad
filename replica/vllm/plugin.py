"""A vLLM general plugin: two read-only utility calls on vLLM's ``EngineCore``.

Why: a kvroute replica running vLLM (:mod:`.vllm_engine`) must report its scheduler's load
(waiting and running requests, queued prefill tokens, decode context, free blocks) and, for
audits and tests, the block hashes its prefix cache holds. Both live in vLLM's engine-core
process, which only answers utility calls -- methods of ``EngineCore`` looked up by name.
vLLM loads the ``vllm.general_plugins`` entry points in every one of its processes, the
engine core's included, so this plugin (registered in kvroute's ``pyproject.toml``) adds
the two methods there. They only read scheduler state between steps (utility calls run on
the engine core's own loop), and are prefixed ``kvroute_`` so they cannot shadow vLLM's.

Loaded in any vLLM process of an environment where kvroute is installed, a plain
``vllm serve`` included: it adds the methods and changes nothing else.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

LOAD_METHOD = "kvroute_load"
CACHED_BLOCKS_METHOD = "kvroute_cached_blocks"


def register() -> None:
    """vLLM's entry point; safe to call many times (vLLM may, once per process)."""
    try:
        from vllm.v1.engine.core import EngineCore
    except Exception:  # an older or partial vLLM: the replica falls back to its own counts
        log.debug("kvroute: vllm.v1.engine.core not importable; no utility calls added")
        return
    if getattr(EngineCore, LOAD_METHOD, None) is not _load:
        setattr(EngineCore, LOAD_METHOD, _load)
        setattr(EngineCore, CACHED_BLOCKS_METHOD, _cached_blocks)


def _load(self: Any) -> list[int]:
    """The scheduler's load as ``LoadReport``'s fields, in its field order (a plain list:
    vLLM's utility channel needs no kvroute type to carry it)."""
    sched = self.scheduler
    running = {id(r) for r in sched.running}
    waiting = queued = decoding = context = 0
    for req in sched.requests.values():
        if req.is_finished():
            continue
        left = req.num_prompt_tokens - req.num_computed_tokens
        if left > 0:
            queued += left
        if id(req) not in running:
            waiting += 1
        elif left <= 0:
            decoding += 1
            context += req.num_computed_tokens
    pool = sched.kv_cache_manager.block_pool
    total = pool.num_gpu_blocks - 1  # block 0 is vLLM's null block, never handed out
    return [waiting, len(running), decoding, queued, context, pool.get_num_free_blocks(), total]


def _cached_blocks(self: Any) -> dict[Any, int]:
    """External block hash (as events carry it) -> cached copies, over every KV group."""
    from vllm.v1.core.kv_cache_utils import get_block_hash, maybe_convert_block_hash

    pool = self.scheduler.kv_cache_manager.block_pool
    out: dict[Any, int] = {}
    for key, blocks in pool.cached_block_hash_to_block._cache.items():
        h = maybe_convert_block_hash(get_block_hash(key))
        out[h] = out.get(h, 0) + (len(blocks) if isinstance(blocks, dict) else 1)
    return out
