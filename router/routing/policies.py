"""Every routing policy by name: :data:`POLICIES` and :func:`make_policy`.

Its own module because it imports both :mod:`.policy` (``kv``) and its comparison set
(:mod:`.baselines`, :mod:`.lora_affinity`), which import :mod:`.policy`: here neither side
imports the other lazily.
"""

from __future__ import annotations

from .baselines import ApproxText, KVLoRABlind, KVTierBlind, LeastLoaded, RandomPolicy, RoundRobin
from .index import PrefixIndex
from .load import LoadTracker
from .lora_affinity import LoRAAffinity
from .policy import KVPolicy, Policy

POLICIES = (
    "kv", "round_robin", "random", "least_loaded", "approx_text", "kv_tier_blind",
    "lora_affinity", "kv:lora_blind",
)  # fmt: skip


def make_policy(
    name: str,
    *,
    index: PrefixIndex | None = None,
    block_size: int = 16,
    seed: int | str = 0,
    load: LoadTracker | None = None,
    **kv_params: float,
) -> Policy:
    """A policy by name. ``kv`` needs the event-fed ``index``; ``approx_text`` chunks by
    ``block_size``; ``kv_params`` (prediction_ttl_s) tune kv."""
    kv_kinds: dict[str, type[KVPolicy]] = {
        "kv": KVPolicy, "kv_tier_blind": KVTierBlind, "kv:lora_blind": KVLoRABlind,
    }  # fmt: skip
    if name in kv_kinds:
        if index is None:
            raise ValueError(f"the {name} policy needs a PrefixIndex fed by the replicas' events")
        return kv_kinds[name](index, load, seed, **kv_params)
    if name == "lora_affinity":
        return LoRAAffinity(load, seed)
    if name == "approx_text":
        return ApproxText(block_size, load, seed)
    simple: dict[str, type[Policy]] = {
        "round_robin": RoundRobin,
        "random": RandomPolicy,
        "least_loaded": LeastLoaded,
    }
    if name not in simple:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
    return simple[name](load, seed)
