"""Disaggregated prefill and decode: whether a request splits, and where each part goes.

A replica has a role (``ReplicaInfo.role``): ``prefill`` replicas compute prompts and hand
the decode off with a lease on the prompt's blocks; ``decode`` replicas take a handed-off
request and pull those blocks (:mod:`kvroute.events.kv_transfer`); ``both`` do whole
requests, as every replica of a unified fleet does. A fleet of only ``both`` never splits.

**Conditional, priced rather than thresholded.** The peers split by a fixed rule: llm-d
when a prompt's uncached tokens reach ``nonCachedTokens``, Dynamo by an input-length
bound. Here a splittable request (more than one token to generate, no prompt logprobs,
not a failover's resume) splits only when splitting costs fewer seconds than running it
whole on the best replica that decodes, in the policy's own seconds
(:class:`~.policy.KVPolicy`, :func:`~.policy.price`), plus one term the unified price
leaves out because there it is the same wherever the request goes:

    stall_r(c) = D_r * max(c - k * headroom_r, 0)
                               the D_r requests decoding on r each wait out the part of
                               this prefill's c seconds of compute that its k chunks do
                               not hide in their steps: a decode step is memory-bound
                               on a GPU, so a chunk rides along for free up to
                               headroom_r = memory_s - compute_s of r's decode step
                               (0 on a CPU, compute-bound: every second stalls)

    whole(r)   = price_r.total + stall_r(prefill_r)                   r decodes (not prefill)
    split(p,d) = P(p) + xfer(p -> d) + Dside(d)                       p prefill, d decodes
    P(p)       = price_p.total - price_p.decode + stall_p(prefill_p)  its prefill, no decode
    xfer       = (nb - h_d / bs) * bs * kv_bytes_per_token / link + RTT
    Dside(d)   = price_d.(wait + decode + evict + capacity)
                 + prefill_s_d(tail) + stall_d(prefill_s_d(tail))     the tail it computes

with ``nb`` the prompt's full blocks, ``h_d`` the decode replica's own hit (not pulled),
``tail`` the prompt tokens past the last full block plus the first token, and ``link`` the
decode replica's reported link bandwidth, else :data:`.fetch.DEFAULT_LINK_BYTES_PER_S`. So a short
or mostly cached prompt, an idle decode replica or a slow link keeps a request whole; a long
prompt headed for a replica full of decoders splits. With a policy that does not price
(a baseline), every splittable request splits, as vLLM's P/D proxies do.

Which replica within a pool is the policy's choice, as for a whole request: the prefill
part is routed among the prefill replicas, the decode part (after the handoff) among the
replicas that decode.

**Pairs on a fleet of ``both`` (opt-in: ``plan(pair=True)``).** Fixed pools idle half the
fleet's decode room and never send a whole request to a prefill replica. With ``pair``, any
replica may take either part, priced per request with the same terms: the request runs
whole on the policy's choice unless some ``split(p, d)`` with ``p != d`` costs less than
the cheapest ``whole(r)`` over all of them (:func:`best_pair`); then its prefill goes to
``p`` and its decode to ``d`` (:attr:`Part.decode`). That is llm-d's "decode pod first,
then maybe a prefill pod" and Dynamo's conditional disaggregation on one pool, with the
fixed thresholds replaced by the price. Without ``pair`` a fleet of ``both`` never splits
and pays one pass over the roles (the routing hot path).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvroute.events.replica_api import GenerateRequest

from .fetch import link_bytes_per_s
from .policy import KVPolicy

if TYPE_CHECKING:
    from kvroute.events.load import CostCoefficients

    from .policy import Decision, Policy, RequestView

ROLE_PREFILL = "prefill"
ROLE_DECODE = "decode"
ROLE_BOTH = "both"
ROLES = (ROLE_PREFILL, ROLE_DECODE, ROLE_BOTH)

# One round trip of the handoff: the pull's request and the decode request's send.
HANDOFF_RTT_S = 1e-3


def can_split(request: GenerateRequest) -> bool:
    """Whether the request has a decode to hand off."""
    sp = request.sampling
    return sp.max_tokens > 1 and sp.prompt_logprobs is None and request.resume is None


@dataclass(frozen=True, slots=True)
class Part:
    """One send of a request: the replicas it may go to, and whether it hands off."""

    candidates: list[str]
    handoff: bool
    # With ``handoff`` on a fleet of ``both`` (``plan(pair=True)``): the replica the price
    # chose for the decode part (None: the policy's choice at the handoff).
    decode: str | None = None


def plan(
    request: GenerateRequest,
    candidates: Sequence[str],
    role_of: Callable[[str], str],
    *,
    decoding: bool,
    view: RequestView | None = None,
    policy: Policy | None = None,
    now: float = 0.0,
    pair: bool = False,
) -> Part:
    """The part of ``request`` to send now. ``decoding``: its first token was made (by a
    prefill replica, or before a failover): it goes to a replica that decodes. ``view``,
    ``policy``: price whether a splittable request splits (module docstring). ``pair``: on
    a fleet of ``both``, a request may split between two of them (module docstring)."""
    roles = [role_of(c) for c in candidates]
    if all(r == ROLE_BOTH for r in roles):  # a unified fleet: one pass, nothing to split
        if not pair or decoding or len(candidates) < 2 or not can_split(request):
            return Part(list(candidates), False)
        if view is None or policy is None or not isinstance(policy, KVPolicy):
            return Part(list(candidates), True)  # always: the decode anywhere but p
        chosen = best_pair(view, policy, candidates, now)
        if chosen is None:
            return Part(list(candidates), False)
        return Part([chosen[0]], True, chosen[1])
    decoders = [c for c, r in zip(candidates, roles, strict=True) if r != ROLE_PREFILL]
    if decoding:
        return Part(decoders or list(candidates), False)
    prefill = [c for c, r in zip(candidates, roles, strict=True) if r == ROLE_PREFILL]
    if prefill and decoders and can_split(request):
        if pair and view is not None and isinstance(policy, KVPolicy):  # whole anywhere
            whole, split, _, _ = _prices(view, policy, prefill, decoders, now, whole=candidates)
            return Part(prefill, True) if split < whole else Part(list(candidates), False)
        if view is None or policy is None or split_pays(view, policy, prefill, decoders, now):
            return Part(prefill, True)
        return Part(decoders, False)
    whole = [c for c, r in zip(candidates, roles, strict=True) if r == ROLE_BOTH]
    return Part(whole or decoders or list(candidates), False)


def split_pays(
    view: RequestView,
    policy: Policy,
    prefill: Sequence[str],
    decoders: Sequence[str],
    now: float,
) -> bool:
    """Whether the cheapest split costs fewer seconds than the cheapest whole run (module
    docstring). True for a policy that does not price (no ``breakdown``)."""
    if not isinstance(policy, KVPolicy):  # a baseline: no price to consult
        return True
    whole, split, _, _ = _prices(view, policy, prefill, decoders, now)
    return split < whole


def best_pair(
    view: RequestView, policy: KVPolicy, replicas: Sequence[str], now: float
) -> tuple[str, str] | None:
    """On a fleet of ``both``: the (prefill, decode) pair, two distinct replicas, whose
    split costs fewer seconds than running the request whole on any of them; None when
    none does (module docstring)."""
    whole, split, p, d = _prices(view, policy, replicas, replicas, now, distinct=True)
    return (p, d) if split < whole and p and d else None


def _prices(
    view: RequestView,
    policy: KVPolicy,
    prefill: Sequence[str],
    decoders: Sequence[str],
    now: float,
    *,
    distinct: bool = False,
    whole: Sequence[str] | None = None,
) -> tuple[float, float, str, str]:
    """(cheapest whole run over ``whole``, else over ``decoders``; cheapest split, its
    prefill and decode replicas). ``distinct``: the two parts on different replicas (pools
    that overlap)."""
    load = policy.load
    match = policy.match(view, now)  # one walk of the index, for the prices and the pulls
    whole_over = decoders if whole is None else whole
    names = list(dict.fromkeys([*prefill, *decoders, *whole_over]))
    parts = policy.breakdown(view, names, now, match)
    n, bs = view.num_prompt_tokens, view.block_size
    full = (n // bs) * bs
    tail = n - full + 1

    default = policy.default_coefficients

    def stall(r: str, compute: float, tokens: int) -> float:
        c = load.coefficients(r) or default
        _, context, decoding, _, _, _ = load.get(r, now)
        return stall_s(c, decoding, context, compute, tokens)

    cheapest = min(parts[r].total + stall(r, parts[r].prefill, n) for r in whole_over)
    pside = {p: parts[p].total - parts[p].decode + stall(p, parts[p].prefill, n) for p in prefill}
    hits = match[0]  # device blocks held per replica: a decode replica pulls the rest
    dside: list[tuple[float, str]] = []
    for d in decoders:
        c = load.coefficients(d) or default
        q = parts[d]
        moved = max(full - hits.get(d, 0) * bs, 0)
        xfer = moved * c.kv_bytes_per_token / link_bytes_per_s(load, d) + HANDOFF_RTT_S
        tail_s = c.prefill_s(tail, n - tail + 1)
        cost = q.wait + q.decode + q.evict + q.capacity + tail_s + stall(d, tail_s, tail)
        dside.append((xfer + cost, d))
    dside.sort()
    best, best_p, best_d = float("inf"), "", ""
    for p, ps in pside.items():
        for ds, d in dside[:2]:  # the cheapest decode side that is not p
            if not distinct or d != p:
                if ps + ds < best:
                    best, best_p, best_d = ps + ds, p, d
                break
    return cheapest, best, best_p, best_d


def route_decode(
    policy: Policy, view: RequestView, candidates: Sequence[str], now: float, lease_tokens: int
) -> Decision:
    """Routes a handed-off request's decode part, and tells the load view what it will
    compute there: the prompt past the ``lease_tokens`` it pulls (its tail), not the whole
    uncached prompt that :meth:`Policy.route` books. Booked as a prefill, the pulled prompt
    made a replica that takes decode parts look queued with prompts it never computes, so
    whole requests avoided it (a fleet of both: TTFT p90 up on conversation)."""
    decision = policy.route(view, candidates, now)
    n, bs = view.num_prompt_tokens, view.block_size
    hit = max(decision.hit_tokens, min(lease_tokens, max(n - 1, 0) // bs * bs))
    out = int(policy.load.expected_output_tokens(view.max_tokens))
    blocks = -(-(n + out) // bs) - decision.hit_tokens // bs  # the pulled ones are new here
    policy.load.on_routed(view.request_id, decision.replica, n - hit, n, blocks)
    return decision


def stall_s(
    c: CostCoefficients, decoding: int, context: int, compute_s: float, tokens: int
) -> float:
    """Seconds the ``decoding`` requests on a replica (``context`` tokens of KV) wait, all
    told, for a prefill of ``compute_s`` seconds over ``tokens`` tokens: what its chunks
    add to their steps past the step's own roofline (module docstring)."""
    if decoding <= 0 or compute_s <= 0.0:
        return 0.0
    compute = decoding * c.prefill_s_per_token + context * c.attention_s_per_pair
    memory = c.weights_read_s + context * c.kv_read_s_per_token
    headroom = memory - compute if memory > compute else 0.0
    chunks = -(-tokens // max(c.max_batched_tokens, 1))
    extra = compute_s - chunks * headroom
    return decoding * extra if extra > 0.0 else 0.0
