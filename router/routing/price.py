"""What one request costs on one replica, in that replica's own seconds: the price the
``kv`` policy routes by (:class:`~.policy.KVPolicy`).

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
(docs/benchmarks-archive.md, *A prefill counted twice*).

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
"""

from __future__ import annotations

from typing import NamedTuple

from kvroute.events.load import CostCoefficients

from .fetch import FETCH_RTT_S
from .load import LoadView

Lower = tuple[tuple[str, int], ...]  # (tier, blocks) beyond the device hit: TierMatch.lower


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
    there are in the module docstring. The reference for :meth:`~.policy.KVPolicy.choose`, which
    computes the same sums inline. ``far`` tokens beyond them it may fetch from another
    replica over a ``link`` of that many bytes/s, where that is cheaper (:mod:`.fetch`)."""
    queued, context, decoding, _, free, total = view
    loaded, load_s = lower_credit(c, lower, block_size) if lower else (0, 0.0)
    _, _, _, fetched = fixed_s(c, n, hit, lower, block_size, far, link)
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


def fixed_s(
    c: CostCoefficients, n: int, hit: int, ext: Lower, bs: int, far: int, link: float
) -> tuple[float, float, int, int]:
    """What :meth:`~.policy.KVPolicy.choose` prices once per (coefficients, hit, tiers, fetch): the
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
