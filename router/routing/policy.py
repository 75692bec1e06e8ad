"""Routing policies: which replica serves a request.

One interface for the simulator and the HTTP front door: the caller hashes the prompt
(fleet hasher, tenant salt), builds a :class:`RequestView`, calls :meth:`Policy.route` with
the replicas it considers alive, and reports :meth:`Policy.on_first_token` and
:meth:`Policy.on_finished` as the response streams. Nothing here knows about simulation.

``kv`` (default) prices, per alive replica and in that replica's own seconds (its
:class:`~kvroute.events.load.CostCoefficients`), every second this request would wait there
or make others wait there, and picks the cheapest (:func:`price`). With ``n`` prompt tokens,
``h`` of them cached there (the event-fed index), ``o`` expected output tokens (the request's
``max_tokens``, else the mean output of finished requests) and the replica's load view
(:class:`~kvroute.router.routing.load.LoadTracker`: ``Q`` queued prefill tokens, ``B`` decoding
requests holding ``C`` KV tokens, ``F`` free blocks of ``T``)::

    wait     = prefill_s_per_token * Q                the prefill queued ahead of it (FCFS)
    prefill  = prefill_s(n - h, cached=h)             its own uncached prefill, quadratic
                                                      in length through attention
    work     = PREFILL_WORK * prefill                 the same compute, as the delay of
                                                      the requests served there after it
    evict    = prefill_s_per_token * (n - h) * R      a full cache makes room for each new
                                                      block by evicting one: priced as the
                                                      R future recomputes it sets off there
    decode   = o * step(B/3 + 1, C/3 + n + o/2)       its own decode steps in that batch
                                                      (memory-bound: a step reads the
                                                      batch's whole context)
    capacity = prefill_s(s) + redo                    s: the tokens of its blocks beyond
                                                      the F free ones; they preempt a
                                                      running request, which waits
                                                      meanwhile, then redoes its KV:
                                                      redo = prefill_s(s), its recompute
                                                      (tiered: or a load, below)

Lower KV tiers (host memory, local disk): the index reports, beyond a replica's device hit
of ``h`` tokens, ``l_t`` more tokens it holds in tier ``t``
(:meth:`~kvroute.router.routing.index.PrefixIndex.match_tiers`). They are neither device hits nor
misses: the engine loads them instead of computing them, so::

    prefill  = prefill_s(n - h - l, cached=h + l) + load     l = sum of l_t over credited tiers
    load     = sum over t of l_t * tier_load_s_per_token(t)  bytes over the tier's bandwidth
    work     = PREFILL_WORK * prefill_s(n - h - l, cached=h + l)   a load is no compute

a lower-tier hit is worth its recompute less its load. Loaded tokens still take new device
blocks, so ``capacity`` counts them as uncached; ``evict`` charges only the tokens a request
computes: the price is for what a request adds to what the replica holds, and a lower-tier
hit adds nothing (it brings a prefix the replica holds up a tier). Charging loaded tokens
too sent conversation turns off their host holder under pressure, and with an 8 GB/s host
link kv lost to tier-blind kv (BENCHMARKS.md, host-tier section). ``evict`` still prices the
``R`` future refetches as recomputes, though a replica with a host tier keeps what it
evicts there: priced as reloads (with a second chain over device and tiers together for
what falls out of the last), the term loses the pressure signal it also carries: on
``agents`` with 2,000-block devices and a 4x host tier, where the host tier holds nothing
useful, more preemptions and tiered kv below device-only kv (18.0 against 19.6 req/s,
2026-11-29; 1.5x the preemptions for plain reloads, 2026-11-28), so it was not kept.
A preempted request's blocks stay cached, and on a tiered replica the blocks evicted to
make room go to the replica's lower tier, so it loads them back (the engine lets a
preempted request load again): ``redo`` in ``capacity`` is the cheaper of the recompute and
that load, from the fastest tier the replica reports a bandwidth for (:func:`preemption_s`).
Its wait for room stays priced at ``prefill_s(s)``; a fast tier shortens only the redo.
Both as recomputes (as before), kv met the SLO at its limit on ``agents`` (500-block
devices, 5.35 req/s) in 1 of 7 runs against tier-blind kv's 4; priced so, 4 against 3.
Pricing both as loads made a preemption almost free and cost conversation turns their
TTFT at 8.3 req/s (3 of 5 runs against 4; BENCHMARKS.md, host-tier section).
A tier the replica's coefficients give no load cost for (an unknown medium) is credited
nothing: its tokens are priced as uncached. ``kv_tier_blind`` is kv as it was before tiers
were told apart: every lower-tier copy counted as a device hit (the baseline the peers'
users warn about).
It and the other baselines live in :mod:`.baselines`; :mod:`.policies` builds any by name.

Why ``R = U / (T - U)`` (:func:`evicted_reuse`), with ``T`` the replica's KV blocks and
``U = T - F + (new blocks of this request)`` those committed to live work (held by its
running requests, placed there by this router since its report, and this one): lazy LRU
keeps every block no request holds cached, so a new block evicts the least recently used
of the ``T - U`` left for cached prefixes. Whether that block is still wanted depends on the
replica's working set of reused prefixes, which the router does not see; taken as equally
likely any size up to the cache, it is wanted with probability ``p = U / T`` (the chance
the working set exceeds what is left). A wanted block, once evicted, is recomputed by the
next request that needs it, and that recompute needs a new block, which evicts another
tail block, wanted with probability ``p`` again: ``p + p^2 + ... = p / (1 - p) = U / (T -
U)`` recomputes per evicted token. At light load (little committed) a miss costs almost no
future work, so work spreads; at half the cache committed it costs one recompute (the
constant this replaced); as the running batch crowds the cache it grows without bound
(``T - U`` is floored at one block), so a saturated replica takes hits and sends its misses
to replicas with room. Signals: the replica's load report (free and total blocks), filled
in by this router's own placements since (:class:`~kvroute.router.routing.load.LoadTracker`);
prompts waiting there since before the report count once admitted, when they hold blocks.
A replica whose size is not known yet is priced ``R = 1``.

Why ``work`` (:data:`PREFILL_WORK`, the prefill's compute counted a second time): a
prefill second is paid once by the request (its time to first token) and once more by the
requests its replica serves after it, which start that much later. Priced only as its own
wait, kv moved a conversation's turn off its holder whenever the holder's queue cost more
than the prefill its hit saved, and the fleet recomputed contexts it held: on the Mooncake
conversation trace with host tiers, 474 of 4,000 turns left the replica holding the most
of their prefix at 1x (0.033 of all prompt tokens recomputed), and at its limit the work
cost the SLO. How many requests a prefill delays grows with the arrival rate and the time
it sits there, ``rate * (wait + prefill)``; priced so (tried 2026-11-29) it kept hot
prefixes on their holders at high rates, where the later arrivals in fact go elsewhere,
and the busiest replica overran its capacity (``tenants``). Counted once more, as the delay
of one request behind it, it raised kv's limit on the adapter workload and one fresh
workload and left the others within their runs' spread (agents on devices too small for
its working set possibly a little lower); weights 0.5 and 2 moved hits and limits little
(BENCHMARKS.md, *A prefill counted twice*).

Why a third of the batch (:data:`DECODE_OVERLAP`): the decoders there are halfway through
their outputs on average, and while they finish, the router sends new arrivals to lighter
replicas, so the gap between two replicas' decode loads closes from both sides, as
``(1 - t/o)^2`` over this request's ``o`` steps: a mean of 1/3. Its own context counts
whole, growing by ``o/2`` on average.

Nothing is tuned per workload: every term is seconds on the replica's own roofline. The
slowdown this request's context adds to the others' decode steps is not priced on top:
it mirrors what theirs adds to its own (the decode term), and counting it twice weighted
decode balance over time to first token with no gain in end-to-end time (measured in the
simulator on every built-in workload). Because a holder's queue and batch grow with every
sibling sent there, a hot prefix stays on one replica only while its hit saves more than
the holder's load costs; then the next sibling pays the prefill once elsewhere and later
ones spread over all holders by load. A cold prefix is never copied: without load there is
nothing to save by moving it.

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
from typing import NamedTuple

from kvroute.events import ExternalBlockHash as Hash
from kvroute.events.load import REFERENCE_COEFFICIENTS, CostCoefficients

from .fetch import FETCH_RTT_S, Holders, link_bytes_per_s
from .index import PrefixIndex, TierMatch
from .load import LoadTracker, LoadView
from .lora_price import AdapterTracker

Lower = tuple[tuple[str, int], ...]  # (tier, blocks) beyond the device hit: TierMatch.lower


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


# The share of a replica's current decode load a new request feels (module docstring).
DECODE_OVERLAP = 1 / 3
# The prefill's compute counted again: the delay of the requests its replica serves after
# it (module docstring).
PREFILL_WORK = 1.0
# Future recomputes an evicted token costs on a replica whose KV size is not known yet
# (module docstring; :func:`evicted_reuse` otherwise): half its cache taken as committed.
EVICTED_REUSE = 1.0


def evicted_reuse(free: int, total: int, new_blocks: int) -> float:
    """Future recomputes each token a placement evicts sets off on a replica with ``free``
    of ``total`` KV blocks unheld (as :meth:`LoadTracker.get` gives them: net of what this
    router placed since the replica's report) and ``new_blocks`` to be taken by this
    request: ``U / (T - U)``, ``U`` the committed blocks (module docstring). 0 on an empty
    cache; ``EVICTED_REUSE`` when ``total`` is 0 (not known yet)."""
    if total <= 0:
        return EVICTED_REUSE
    left = free - new_blocks
    if left >= total:
        return 0.0
    if left < 1:
        left = 1
    return (total - left) / left


class CostParts(NamedTuple):
    """Predicted seconds of serving one request on one replica, by part."""

    wait: float
    prefill: float
    evict: float
    decode: float
    capacity: float
    load: float = 0.0  # loading its lower-tier blocks into the device
    adapter: float = 0.0  # its LoRA adapter's load, slot wait and eviction (lora_price)
    work: float = 0.0  # its prefill's compute again: what the requests after it wait
    fetch: float = 0.0  # pulling its prefix from another replica's cache (:mod:`.fetch`)

    @property
    def total(self) -> float:
        return (
            self.wait + self.prefill + self.evict + self.decode + self.capacity + self.load
            + self.adapter + self.work + self.fetch
        )  # fmt: skip


def lower_credit(c: CostCoefficients, lower: Lower, block_size: int) -> tuple[int, float]:
    """(tokens, seconds): the lower-tier tokens a replica with coefficients ``c`` loads
    instead of computing, and the load's time; tiers it gives no load cost for are left
    out (their tokens are computed)."""
    tokens, seconds = 0, 0.0
    for tier, blocks in lower:
        per = c.tier_load_s_per_token(tier)
        if per is not None:
            tokens += blocks * block_size
            seconds += blocks * block_size * per
    return tokens, seconds


def preemption_s(c: CostCoefficients, tokens: int) -> float:
    """Seconds a placement ``tokens`` short of free blocks costs by preempting a running
    request there: it waits a recompute's time for room, then redoes its KV, by recompute,
    or, where the replica reports a lower tier's bandwidth (its evicted blocks land there),
    by a load from the fastest such tier when that is cheaper (module docstring)."""
    redo = recompute = c.prefill_s(tokens)
    for tier in c.tier_bytes_per_s:  # the tiers it has: evicted blocks go there
        per = c.tier_load_s_per_token(tier)
        if per is not None and tokens * per < redo:
            redo = tokens * per
    return recompute + redo


def price(
    c: CostCoefficients,
    view: LoadView,
    n: int,
    hit: int,
    out: float,
    block_size: int,
    lower: Lower = (),
    far: int = 0,
    link: float = 0.0,
) -> CostParts:
    """The seconds a request of ``n`` prompt tokens (``hit`` in the device cache there,
    ``lower`` blocks beyond it in lower tiers, ``out`` expected output tokens) costs on a
    replica with coefficients ``c`` and load ``view``; the formula and why each term is
    there are in the module docstring. The reference for :meth:`KVPolicy.choose`, which
    computes the same sums inline. ``far`` tokens beyond them it may fetch from another
    replica over a ``link`` of that many bytes/s, where that is cheaper (:mod:`.fetch`)."""
    queued, context, decoding, _, free, total = view
    loaded, load_s = lower_credit(c, lower, block_size) if lower else (0, 0.0)
    _, _, _, fetched = _fixed_s(c, n, hit, lower, block_size, far, link)
    f = DECODE_OVERLAP
    decode = out * c.decode_step_s(f * decoding + 1, f * context + n + 0.5 * out)
    new_blocks = -(-(n + int(out)) // block_size) - hit // block_size
    short = new_blocks - free
    reuse = evicted_reuse(free, total, new_blocks)
    cached = hit + loaded
    compute = c.prefill_s(n - cached - fetched, cached + fetched)
    return CostParts(
        wait=queued * c.prefill_s_per_token,
        prefill=compute,
        evict=(n - hit - loaded) * c.prefill_s_per_token * reuse,
        decode=decode,
        capacity=preemption_s(c, short * block_size) if short > 0 else 0.0,
        load=load_s,
        work=PREFILL_WORK * compute,
        fetch=fetched * c.kv_bytes_per_token / link + FETCH_RTT_S if fetched else 0.0,
    )


def _fixed_s(
    c: CostCoefficients, n: int, hit: int, ext: Lower, bs: int, far: int, link: float
) -> tuple[float, float, int, int]:
    """What :meth:`KVPolicy.choose` prices once per (coefficients, hit, tiers, fetch): the
    prefill with its work and loads, the recompute of what it evicts, the tokens loaded
    from lower tiers, and those fetched (0: recomputing them is cheaper; :mod:`.fetch`)."""
    loaded, load_s = lower_credit(c, ext, bs) if ext else (0, 0.0)
    cached = hit + loaded
    prefill = (1.0 + PREFILL_WORK) * c.prefill_s(n - cached, cached) + load_s
    fetched = 0
    if far and c.kv_bytes_per_token > 0:
        got = cached + far
        fetch_s = far * c.kv_bytes_per_token / link + FETCH_RTT_S
        alt = (1.0 + PREFILL_WORK) * c.prefill_s(n - got, got) + load_s + fetch_s
        if alt < prefill:
            prefill, fetched = alt, far
    return prefill, (n - cached) * c.prefill_s_per_token, loaded, fetched


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
    """Event-driven prefix index + load, priced in seconds: see the module docstring."""

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
        fixed: dict[tuple[int, int, Lower, int, float], tuple[float, float, int, int]] = {}
        best, fewest, tied = float("inf"), 0, []
        adapter = req.lora_name if self.price_adapters else None
        fetchable = self.fetchable
        holders = Holders(matched, fetchable) if fetchable is not None and matched else None
        for r in replicas:
            queued, context, decoding, count, free, total = load(r, now)
            c = coef(r) or default
            blocks = matched.get(r, 0)
            ext = lower.get(r, ()) if lower else ()
            far, link = (0, 0.0) if holders is None else self._far(r, blocks, ext, holders)
            key = (id(c), blocks, ext, far, link)
            triple = fixed.get(key)
            if triple is None:  # prefill and work (and loads), one recompute of what it evicts
                triple = fixed[key] = _fixed_s(c, n, blocks * bs, ext, bs, far * bs, link)
            base, recompute, _, _ = triple
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
        far, link = self._far(r, held, ext, holders)
        _, _, loaded, fetched = fixed[(id(coef(r) or default), held, ext, far, link)]
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
        self.adapters.finished(request_id)
        super().on_finished(request_id, now, output_tokens)

    def on_replica_removed(self, replica: str) -> list[str]:
        self.index.drop_replica(replica)
        self.adapters.drop_replica(replica)
        return super().on_replica_removed(replica)
