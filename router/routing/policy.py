"""Routing policies: which replica serves a request.

One interface for the simulator and the HTTP front door: the caller hashes the prompt
(fleet hasher, tenant salt), builds a :class:`RequestView`, calls :meth:`Policy.route` with
the replicas it considers alive, and reports :meth:`Policy.on_first_token` and
:meth:`Policy.on_finished` as the response streams. Nothing here knows about simulation.

``kv`` (default) prices, per alive replica and in that replica's own seconds, every second
this request would wait there or make others wait there, and picks the cheapest: the price
and why each of its terms is there are in :mod:`.price`; a prefix held elsewhere may be
fetched (:mod:`.fetch`).

Ties go to fewer requests in flight, then to a seeded coin. Once routed, the request's
blocks are predicted on that replica for ``prediction_ttl_s`` so a burst of siblings
follows it before its BlockStored events arrive.

Invariants:
- ``route`` returns one of the replicas it was given, never another (a dead or removed
  replica is simply not passed in), and raises :class:`NoReplicaError` when given none;
- hits are counted only along the request's own salted hash chain, so a tenant can never be
  credited with another tenant's blocks (``approx_text`` deliberately ignores salts, as a
  text tree does, and is only a baseline);
- a hit never exceeds ``num_prompt_tokens - 1`` (the engine always computes one token).
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvroute.events import ExternalBlockHash as Hash
from kvroute.events.load import REFERENCE_COEFFICIENTS, CostCoefficients

from .fetch import Holders, link_bytes_per_s
from .index import PrefixIndex, TierMatch
from .load import LoadTracker
from .lora_price import AdapterTracker
from .price import (  # re-exported: the policy's price is imported from here too
    DECODE_OVERLAP,
    EVICTED_REUSE,
    PREFILL_WORK,
    CostParts,
    Lower,
    evicted_reuse,
    fixed_s,
    lower_credit,
    preemption_s,
    price,
)

__all__ = [
    "DECODE_OVERLAP", "EVICTED_REUSE", "PREFILL_WORK", "CostParts", "Decision", "KVPolicy",
    "Lower", "NoReplicaError", "Policy", "RequestView", "evicted_reuse", "lower_credit",
    "preemption_s", "price",
]  # fmt: skip


class NoReplicaError(RuntimeError):
    """No alive replica to route to (``code``/``param``: what the 503 names, if any)."""

    def __init__(self, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.param = code, param


@dataclass(slots=True)
class RequestView:
    """What a policy may know of a request."""

    request_id: str
    num_prompt_tokens: int
    block_hashes: Sequence[Hash]  # the prompt's full blocks, fleet hasher, tenant salt
    block_size: int
    token_ids: Sequence[int] | None = None  # for text-tree baselines
    max_tokens: int | None = None  # the request's output cap, if it set one
    # False: it computes every prompt token whatever is cached (it asked for the prompt's
    # logprobs), so no replica's cache saves it anything; its blocks are still stored.
    reads_cache: bool = True
    lora_name: str | None = None  # the LoRA adapter it names (None: the base model)


@dataclass(frozen=True, slots=True)
class Decision:
    replica: str
    hit_tokens: int  # tokens the policy expects the replica to have cached (0: unknown)
    # Why (for /metrics): cache_hit -- it holds the longest cached prefix; load -- another
    # held more, or load alone decided; spread -- no cache or load figure was used, or no
    # replica held any of the prefix; fetch -- it pulls the prefix from another's cache.
    reason: str = "spread"
    loaded_tokens: int = 0  # beyond hit_tokens: tokens it expects loaded from lower tiers
    # A prefix fetch (:mod:`.fetch`): the replica to pull from, and its blocks of the prompt.
    fetch_from: str | None = None
    fetch_blocks: int = 0


class Policy(ABC):
    """Base: load accounting and the route/notify cycle; subclasses only choose."""

    name = "policy"

    def __init__(self, load: LoadTracker | None = None, seed: int | str = 0) -> None:
        self.load = load if load is not None else LoadTracker()
        self.rng = random.Random(f"{self.name}:{seed}")

    @abstractmethod
    def choose(self, req: RequestView, replicas: Sequence[str], now: float) -> Decision: ...

    def route(self, req: RequestView, replicas: Sequence[str], now: float) -> Decision:
        if not replicas:
            raise NoReplicaError(f"no replica to route {req.request_id!r} to")
        decision = self.choose(req, replicas, now)
        self.on_routed(req, decision, now)
        return decision

    def on_routed(self, req: RequestView, decision: Decision, now: float) -> None:
        n, bs, hit = req.num_prompt_tokens, req.block_size, decision.hit_tokens
        out = int(self.load.expected_output_tokens(req.max_tokens))
        blocks = -(-(n + out) // bs) - hit // bs  # loaded tokens take new blocks too
        prefill = n - hit - decision.loaded_tokens
        self.load.on_routed(req.request_id, decision.replica, prefill, n, blocks)

    def on_first_token(self, request_id: str, now: float) -> None:
        self.load.on_first_token(request_id)

    def on_finished(self, request_id: str, now: float, output_tokens: int | None = None) -> None:
        """The request ended (``output_tokens`` generated, when known: it teaches the load
        view what a request without ``max_tokens`` is expected to generate)."""
        self.load.on_finished(request_id, output_tokens)

    def on_replica_removed(self, replica: str) -> list[str]:
        """Forget a replica; returns the requests that were in flight there."""
        return self.load.drop_replica(replica)

    def _least(self, replicas: Sequence[str], key: dict[str, float]) -> str:
        low = min(key[r] for r in replicas)
        return self.rng.choice([r for r in replicas if key[r] == low])


class KVPolicy(Policy):
    """Event-driven prefix index + load, priced in seconds (:mod:`.price`)."""

    name = "kv"
    price_adapters = True  # LoRA adapters priced (:mod:`.lora_price`); kv:lora_blind: not

    def __init__(
        self,
        index: PrefixIndex,
        load: LoadTracker | None = None,
        seed: int | str = 0,
        prediction_ttl_s: float = 10.0,
        default_coefficients: CostCoefficients = REFERENCE_COEFFICIENTS,
    ) -> None:
        super().__init__(load, seed)
        self.index = index
        self.prediction_ttl_s = prediction_ttl_s
        self.default_coefficients = default_coefficients
        self.adapters = AdapterTracker(prediction_ttl_s)
        # Prefix fetch (:mod:`.fetch`): whether a replica can pull from and serve to others
        # (it runs a transfer plane); None: never fetch.
        self.fetchable: Callable[[str], object] | None = None

    def _adapter_s(
        self, c: CostCoefficients, r: str, adapter: str, drain_s: float, batch: int, now: float
    ) -> float:
        """The adapter's load, slot wait and eviction there (:mod:`.lora_price`)."""
        report, at = self.load.report_of(r)
        return sum(self.adapters.price(c, r, adapter, report, at, drain_s, batch, now))

    def match(self, req: RequestView, now: float) -> tuple[dict[str, int], dict[str, Lower]]:
        """Leading blocks held per replica: on the device, and beyond in lower tiers."""
        return self._match(req, now)

    def _match(self, req: RequestView, now: float) -> tuple[dict[str, int], dict[str, Lower]]:
        """Leading blocks held per replica, over the blocks a hit may cover (prompt - 1): in
        its device cache, and beyond them in its lower tiers (empty while no replica has
        stored to one: the device walk alone)."""
        cap = max(req.num_prompt_tokens - 1, 0) // req.block_size
        if not cap or not req.reads_cache:
            return {}, {}
        hashes = req.block_hashes
        hashes = hashes[:cap] if len(hashes) > cap else hashes
        if not self.index.has_lower_tiers:
            return self.index.match(hashes, now), {}
        return self._split(self.index.match_tiers(hashes, now))

    def _split(self, matched: dict[str, TierMatch]) -> tuple[dict[str, int], dict[str, Lower]]:
        """Device hits, and the lower-tier extensions where there are any."""
        return (
            {r: m.device for r, m in matched.items() if m.device},
            {r: m.lower for r, m in matched.items() if m.lower},
        )

    def breakdown(
        self,
        req: RequestView,
        replicas: Sequence[str],
        now: float,
        match: tuple[dict[str, int], dict[str, Lower]] | None = None,
    ) -> dict[str, CostParts]:
        """Per replica, the predicted seconds by part (for inspection, tests, logs and the
        P/D split's price). ``match``: :meth:`match`'s answer, when the caller has it."""
        matched, lower = match if match is not None else self._match(req, now)
        o = self.load.expected_output_tokens(req.max_tokens)
        out = {}
        n, bs = req.num_prompt_tokens, req.block_size
        adapter = req.lora_name if self.price_adapters else None
        fetchable = self.fetchable
        holders = Holders(matched, fetchable) if fetchable is not None and matched else None
        for r in replicas:
            c = self.load.coefficients(r) or self.default_coefficients
            blocks, ext = matched.get(r, 0), lower.get(r, ())
            far, link = (0, 0.0) if holders is None else self._far(r, blocks, ext, holders)
            view = self.load.get(r, now)
            parts = price(c, view, n, blocks * bs, o, bs, ext, far * bs, link)
            if adapter is not None:
                s = self._adapter_s(c, r, adapter, parts.decode, view[2], now)
                parts = parts._replace(adapter=s)
            out[r] = parts
        return out

    def costs(self, req: RequestView, replicas: Sequence[str], now: float) -> dict[str, float]:
        return {r: p.total for r, p in self.breakdown(req, replicas, now).items()}

    def choose(self, req: RequestView, replicas: Sequence[str], now: float) -> Decision:
        """Lowest (seconds, requests in flight), then a seeded coin among the tied.

        :func:`price`'s sums, inline: this loop and the index walk are the routing hot path.
        What depends only on the replica's coefficients and hit (its prefill, lower-tier
        loads included, and the tokens an eviction would cost to recompute) is computed once
        per distinct pair, so a fleet of one hardware kind pays it once for all the replicas
        that miss."""
        (matched, lower), n, bs = self._match(req, now), req.num_prompt_tokens, req.block_size
        out = self.load.expected_output_tokens(req.max_tokens)
        load, coef, default = self.load.get, self.load.coefficients, self.default_coefficients
        f, own_ctx = DECODE_OVERLAP, n + 0.5 * out
        need = -(-(n + int(out)) // bs)
        fixed: dict[tuple, tuple[float, float, int, int]] = {}
        best, fewest, tied = float("inf"), 0, []
        adapter = req.lora_name if self.price_adapters else None
        fetchable = self.fetchable
        holders = Holders(matched, fetchable) if fetchable is not None and matched else None
        for r in replicas:
            queued, context, decoding, count, free, total = load(r, now)
            c = coef(r) or default
            blocks = matched.get(r, 0)
            ext = lower.get(r, ()) if lower else ()
            if holders is None:  # no fetch: the key of the sums as they were before it
                far, link, key = 0, 0.0, (id(c), blocks, ext)
            else:
                far, link = self._far(r, blocks, ext, holders)
                key = (id(c), blocks, ext, far, link)
            triple = fixed.get(key)
            if triple is None:  # prefill and work (and loads), one recompute of what it evicts
                triple = fixed[key] = fixed_s(c, n, blocks * bs, ext, bs, far * bs, link)
            base, recompute = triple[0], triple[1]
            left = free - need + blocks  # blocks left once its own are placed; < 0: short
            if total > 0:  # evicted_reuse, inline
                if left < total:
                    rest = left if left >= 1 else 1
                    base += recompute * ((total - rest) / rest)
            else:
                base += EVICTED_REUSE * recompute
            ctx = f * context + own_ctx
            compute = (f * decoding + 1) * c.prefill_s_per_token + ctx * c.attention_s_per_pair
            memory = c.weights_read_s + ctx * c.kv_read_s_per_token
            decode = out * (c.step_overhead_s + (compute if compute > memory else memory))
            cost = base + queued * c.prefill_s_per_token + decode
            if adapter is not None:
                cost += self._adapter_s(c, r, adapter, decode, decoding, now)
            if left < 0:  # short of blocks: preemption
                cost += preemption_s(c, -left * bs)
            if cost < best or (cost == best and count < fewest):
                best, fewest, tied = cost, count, [r]
            elif cost == best and count == fewest:
                tied.append(r)
        r = tied[0] if len(tied) == 1 else self.rng.choice(tied)
        held = matched.get(r, 0)
        ext = lower.get(r, ()) if lower else ()
        c = coef(r) or default
        if holders is None:
            loaded, fetched = fixed[(id(c), held, ext)][2], 0
        else:
            far, link = self._far(r, held, ext, holders)
            _, _, loaded, fetched = fixed[(id(c), held, ext, far, link)]
        if fetched:
            assert holders is not None
            blocks, holder = holders.best_for(r)
            return Decision(r, held * bs, "fetch", loaded, holder, blocks)
        if lower:
            span = {x: matched.get(x, 0) + sum(b for _, b in lower.get(x, ())) for x in replicas}
            mine, most = span[r], max(span.values(), default=0)
        else:
            mine, most = held, max(matched.values(), default=0)
        reason = "spread" if not most else "cache_hit" if mine == most else "load"
        return Decision(r, held * bs, reason, loaded)

    def _far(self, r: str, blocks: int, ext: Lower, holders: Holders | None) -> tuple[int, float]:
        """(blocks, link): what ``r`` could fetch of the prefix, beyond its own device and
        lower-tier blocks, from its best other holder, and at what bytes/s (:mod:`.fetch`);
        (0, 0.0) where it cannot."""
        if holders is None or not self.fetchable(r):  # type: ignore[misc]
            return 0, 0.0
        far = holders.best_for(r)[0] - blocks
        for _, b in ext:
            far -= b
        return (far, link_bytes_per_s(self.load, r)) if far > 0 else (0, 0.0)

    def on_routed(self, req: RequestView, decision: Decision, now: float) -> None:
        super().on_routed(req, decision, now)
        if req.lora_name is not None:
            self.adapters.routed(req.request_id, decision.replica, req.lora_name, now)
        cap = max(req.num_prompt_tokens - 1, 0) // req.block_size
        if cap:
            hashes = req.block_hashes
            hashes = hashes[:cap] if len(hashes) > cap else hashes
            self.index.predict(decision.replica, hashes, self.prediction_ttl_s, now)

    def on_finished(self, request_id: str, now: float, output_tokens: int | None = None) -> None:
        if request_id in self.adapters.flights:  # under an adapter
            self.adapters.finished(request_id)
        super().on_finished(request_id, now, output_tokens)

    def on_replica_removed(self, replica: str) -> list[str]:
        self.index.drop_replica(replica)
        self.adapters.drop_replica(replica)
        return super().on_replica_removed(replica)
