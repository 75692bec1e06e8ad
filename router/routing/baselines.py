"""The baseline policies: what ``kv`` is measured against, not what a fleet runs.

``round_robin``, ``random`` and ``least_loaded`` know no cache; ``approx_text`` is
SGLang-style routing over a tree of what it sent where; ``kv_tier_blind`` and
``kv:lora_blind`` are kv with one signal taken away (lower tiers counted as device hits,
adapters left unpriced). ``lora_affinity`` (llm-d's adapter scorer) has its own module,
:mod:`.lora_affinity`. They live apart from :mod:`.policy` because they are the comparison
set and ``kv`` is the product: the shared types and kv's price stay readable there, and a
baseline can change without touching the routing hot path. :mod:`.policies` builds any of
them by name.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.events import BlockHasher, BlockStored, EventBatch

from .index import PrefixIndex, TierMatch
from .load import LoadTracker
from .policy import Decision, KVPolicy, Lower, Policy, RequestView


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self, load: LoadTracker | None = None, seed: int | str = 0) -> None:
        super().__init__(load, seed)
        self._next = 0

    def choose(self, req: RequestView, replicas: Sequence[str], now: float) -> Decision:
        r = replicas[self._next % len(replicas)]
        self._next += 1
        return Decision(r, 0)


class RandomPolicy(Policy):
    name = "random"

    def choose(self, req: RequestView, replicas: Sequence[str], now: float) -> Decision:
        return Decision(self.rng.choice(list(replicas)), 0)


class LeastLoaded(Policy):
    """Fewest requests in flight (the router's count), ties at random."""

    name = "least_loaded"

    def choose(self, req: RequestView, replicas: Sequence[str], now: float) -> Decision:
        counts = {r: float(self.load.get(r, now)[3]) for r in replicas}
        return Decision(self._least(replicas, counts), 0, "load")


class KVLoRABlind(KVPolicy):
    """kv with requests' adapters left out of the price (their blocks still hash apart): a
    baseline to measure adapter pricing against."""

    name = "kv:lora_blind"
    price_adapters = False


class KVTierBlind(KVPolicy):
    """kv with every lower-tier copy counted as a device hit, as the index counted them
    before it told tiers apart (and as peers' routers still do): a baseline to measure
    tier-aware pricing against, not a policy to run."""

    name = "kv_tier_blind"

    def _split(self, matched: dict[str, TierMatch]) -> tuple[dict[str, int], dict[str, Lower]]:
        return {r: m.blocks for r, m in matched.items()}, {}


class ApproxText(Policy):
    """SGLang-style cache-aware routing over an approximate tree of what was routed where.

    The tree records each request's prompt for the replica it was sent to -- never what the
    engines actually hold or evicted -- and forgets only by its own LRU size bound. Rules,
    with SGLang router's defaults (cache threshold 0.3, balance thresholds 64 absolute and
    1.5 relative): if the fleet is imbalanced (max - min in-flight > abs and max > rel *
    min), send to the least loaded; else if the best match covers more than the threshold of
    the prompt, send there; else send to the replica with the smallest tree.

    The tree is over token chunks of ``chunk_tokens`` (chained hashes); with the
    simulator's 512-token blocks this matches at the trace's own granularity, where a
    character tree could resolve no finer sharing. Its chains are salted with the request's
    first fleet block hash, which carries the tenant's salt: one tenant's prompts never
    match another's, so routing reveals nothing of where another tenant's text went (a
    prompt with no full block is never recorded or matched).
    """

    name = "approx_text"

    def __init__(
        self,
        chunk_tokens: int,
        load: LoadTracker | None = None,
        seed: int | str = 0,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        max_tree_tokens: int = 2**26,
    ) -> None:
        super().__init__(load, seed)
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.hasher = BlockHasher(block_size=chunk_tokens)
        self.tree = PrefixIndex(max_blocks_per_replica=max(1, max_tree_tokens // chunk_tokens))
        self._pending: dict[str, list[bytes]] = {}

    def choose(self, req: RequestView, replicas: Sequence[str], now: float) -> Decision:
        if req.token_ids is None:
            raise ValueError("approx_text needs the request's token ids")
        # Block 0's fleet hash names the tenant salt (and the first tokens, which every
        # chunk chain starts with anyway): a tree keyed by it is a tree per tenant.
        salt = str(req.block_hashes[0]) if req.block_hashes else None
        chunks = self.hasher.hash_blocks(req.token_ids, cache_salt=salt) if salt else []
        self._pending[req.request_id] = chunks
        counts = {r: float(self.load.get(r, now)[3]) for r in replicas}
        hi, lo = max(counts.values()), min(counts.values())
        if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
            return Decision(self._least(replicas, counts), 0, "load")
        matched = self.tree.match(chunks, now)
        alive = [r for r in replicas if r in matched]
        if alive:
            best = max(matched[r] for r in alive)
            rate = best * self.hasher.block_size / max(req.num_prompt_tokens, 1)
            if rate > self.cache_threshold:
                pick = self.rng.choice([r for r in alive if matched[r] == best])
                return Decision(pick, 0, "cache_hit")
        sizes = {r: float(self.tree.num_blocks(r)) for r in replicas}
        return Decision(self._least(replicas, sizes), 0, "spread")

    def on_routed(self, req: RequestView, decision: Decision, now: float) -> None:
        super().on_routed(req, decision, now)
        chunks = self._pending.pop(req.request_id, None)
        if chunks:
            bs = self.hasher.block_size
            ev = BlockStored(list(chunks), None, [], bs, None, None, None)
            self.tree.apply(decision.replica, EventBatch(now, [ev]))

    def on_replica_removed(self, replica: str) -> list[str]:
        self.tree.drop_replica(replica)
        return super().on_replica_removed(replica)
