"""kv's price of a lower-tier hit: between a device hit and a miss, at bytes over the tier's
bandwidth as the replica reports it (or a conservative share of a prefill where it does
not), nothing for an unknown medium; ``kv_tier_blind`` (every copy a device hit) beside it;
the inline choice equal to the reference ``price``."""

from __future__ import annotations

import random

import msgspec
import pytest

from kvroute.events import BlockHasher, BlockStored, EventBatch
from kvroute.events.load import DEFAULT_TIER_LOAD_SHARE, REFERENCE_COEFFICIENTS
from kvroute.router.routing.baselines import KVTierBlind
from kvroute.router.routing.index import PrefixIndex
from kvroute.router.routing.policies import POLICIES, make_policy
from kvroute.router.routing.policy import PREFILL_WORK, KVPolicy, RequestView, price

BS = 16
HASHER = BlockHasher(block_size=BS)
C = REFERENCE_COEFFICIENTS  # Llama-3.1-8B on an H100: 128 KiB of KV per token
TIERED = msgspec.structs.replace(C, tier_bytes_per_s={"CPU": 25e9, "STORAGE": 3e9})
PROMPT = list(range(4096))


def hold(index: PrefixIndex, replica: str, tokens: list[int], medium: str = "GPU") -> None:
    hashes = HASHER.hash_blocks(tokens)
    ev = BlockStored(hashes, None, tokens[: len(hashes) * BS], BS, None, medium, None)
    index.apply(replica, EventBatch(0.0, [ev]))


def view(tokens: list[int], rid: str = "q") -> RequestView:
    return RequestView(rid, len(tokens), HASHER.hash_blocks(tokens), BS, tokens, max_tokens=64)


def fleet(cls=KVPolicy, coefficients=TIERED, medium: str = "CPU") -> KVPolicy:
    """``device`` holds the prompt's first 3,072 tokens on its device, ``lower`` in
    ``medium``, ``split`` 1,024 on the device and 2,048 more in ``medium``, ``none``
    nothing. Same coefficients and no load anywhere: only the hit differs."""
    index = PrefixIndex()
    hold(index, "device", PROMPT[:3072])
    hold(index, "lower", PROMPT[:3072], medium)
    hold(index, "split", PROMPT[:1024])
    hold(index, "split", PROMPT[:3072], medium)
    policy = cls(index, seed=3)
    for r in ("device", "lower", "split", "none"):
        policy.load.register(r, coefficients, 100_000)
    return policy


REPS = ["device", "lower", "split", "none"]


def test_a_lower_tier_hit_is_priced_between_a_device_hit_and_a_miss():
    policy = fleet()
    costs = policy.costs(view(PROMPT), REPS, 0.0)
    assert costs["device"] < costs["split"] < costs["lower"] < costs["none"]
    parts = policy.breakdown(view(PROMPT), REPS, 0.0)
    # the load: its bytes over the bandwidth the replica reported
    assert parts["lower"].load == pytest.approx(3072 * C.kv_bytes_per_token / 25e9)
    assert parts["lower"].prefill == pytest.approx(C.prefill_s(1024, 3072))
    assert parts["split"].load == pytest.approx(2048 * C.kv_bytes_per_token / 25e9)
    assert parts["device"].load == parts["none"].load == 0
    # worth its recompute (the prefill, and the same compute as others' delay) less its load
    recompute = parts["none"].prefill - parts["lower"].prefill
    assert parts["none"].work - parts["lower"].work == pytest.approx(PREFILL_WORK * recompute)
    saved = (1 + PREFILL_WORK) * recompute - parts["lower"].load
    assert costs["none"] - costs["lower"] == pytest.approx(saved, rel=0.05)
    # loaded tokens take device blocks (capacity) but add nothing to what the replica holds:
    # only computed tokens pay the eviction price, at the same rate per token as a miss's
    assert parts["lower"].evict == pytest.approx(parts["none"].evict * 1024 / 4096)
    assert 0 < parts["lower"].evict < parts["none"].evict


def test_route_takes_the_lower_tier_copy_over_a_miss_and_says_what_it_loads():
    policy = fleet()
    d = policy.route(view(PROMPT, "a"), ["lower", "none"], 0.0)
    assert d.replica == "lower" and d.hit_tokens == 0 and d.loaded_tokens == 3072
    assert d.reason == "cache_hit"
    # the router's load view: its prefill is what is not loaded, its blocks all of it
    queued, *_ = policy.load.get("lower", 0.0)
    assert queued == 4096 - 3072
    assert fleet().route(view(PROMPT, "b"), REPS, 0.0).replica == "device"


def test_unknown_bandwidth_falls_back_to_a_conservative_share_never_free_never_a_miss():
    for coefficients in (C, msgspec.structs.replace(C, kv_bytes_per_token=0)):
        policy = fleet(coefficients=coefficients, medium="STORAGE")
        parts = policy.breakdown(view(PROMPT), REPS, 0.0)
        share = DEFAULT_TIER_LOAD_SHARE["STORAGE"]
        assert parts["lower"].load == pytest.approx(3072 * share * C.prefill_s_per_token)
        costs = {r: p.total for r, p in parts.items()}
        assert costs["device"] < costs["lower"] < costs["none"]


def test_an_unknown_medium_is_credited_nothing_unless_the_replica_prices_it():
    policy = fleet(medium="lmcache-disk")
    costs = policy.costs(view(PROMPT), REPS, 0.0)
    assert costs["lower"] == pytest.approx(costs["none"])  # its tokens are computed
    assert costs["device"] < costs["split"] < costs["none"]  # the device part still counts
    reporting = msgspec.structs.replace(TIERED, tier_bytes_per_s={"lmcache-disk": 5e9})
    costs = fleet(coefficients=reporting, medium="lmcache-disk").costs(view(PROMPT), REPS, 0.0)
    assert costs["device"] < costs["lower"] < costs["none"]


def test_a_preemption_on_a_tiered_replica_is_a_wait_and_a_reload_not_two_recomputes():
    """The request a short placement preempts loses its blocks to the lower tier, loads
    them back, and waits meanwhile as it would for a recompute."""
    need = -(-(1000 + 200) // BS)
    short = 10 * BS  # tokens in blocks beyond the free ones
    tight = (0, 0, 0, 0, need - 10, 0)
    assert price(C, tight, 1000, 0, 200, BS).capacity == pytest.approx(2 * C.prefill_s(short))
    reload = short * C.kv_bytes_per_token / 25e9  # the faster of TIERED's two tiers
    assert reload < C.prefill_s(short)
    got = price(TIERED, tight, 1000, 0, 200, BS).capacity
    assert got == pytest.approx(C.prefill_s(short) + reload)
    # a tier whose bandwidth comes without a KV size: the conservative share of a prefill
    sized = msgspec.structs.replace(TIERED, kv_bytes_per_token=0)
    share = DEFAULT_TIER_LOAD_SHARE["CPU"] * C.prefill_s_per_token * short
    got = price(sized, tight, 1000, 0, 200, BS).capacity
    assert got == pytest.approx(C.prefill_s(short) + min(share, C.prefill_s(short)))
    # a tier slower than a recompute: the recompute
    slow = msgspec.structs.replace(C, tier_bytes_per_s={"STORAGE": 1e6})
    assert price(slow, tight, 1000, 0, 200, BS).capacity == pytest.approx(2 * C.prefill_s(short))


def test_tier_blind_counts_lower_tier_copies_as_device_hits():
    """The baseline: today's bug, kept to be measured against."""
    policy = fleet(KVTierBlind)
    costs = policy.costs(view(PROMPT), REPS, 0.0)
    assert costs["device"] == pytest.approx(costs["lower"]) == pytest.approx(costs["split"])
    d = policy.route(view(PROMPT, "a"), ["lower", "none"], 0.0)
    assert d.hit_tokens == 3072 and d.loaded_tokens == 0
    assert "kv_tier_blind" in POLICIES
    assert isinstance(make_policy("kv_tier_blind", index=PrefixIndex()), KVTierBlind)


def test_the_inline_choice_is_the_cheapest_by_the_reference_price():
    """choose() computes price()'s sums inline; over random holdings in three tiers and
    random load, it picks a replica whose reference price is the lowest."""
    rng = random.Random(11)
    for trial in range(40):
        index = PrefixIndex()
        reps = [f"r{i}" for i in range(5)]
        policy = KVPolicy(index, seed=trial)
        prompt = [rng.randrange(1000) for _ in range(rng.choice((512, 2048, 6000)))]
        for r in reps:
            n = rng.randrange(0, len(prompt))
            hold(index, r, prompt[: rng.randrange(0, n + 1)])
            hold(index, r, prompt[:n], rng.choice(("CPU", "STORAGE", "other")))
            policy.load.register(r, rng.choice((C, TIERED)), rng.choice((400, 20_000)))
            for k in range(rng.randrange(3)):
                policy.load.on_routed(f"{r}-{k}", r, rng.randrange(8000), 4000, 300)
        req = view(prompt, f"t{trial}")
        costs = policy.costs(req, reps, 0.0)
        pick = policy.choose(req, reps, 0.0).replica
        assert costs[pick] == pytest.approx(min(costs.values()), rel=1e-9), (trial, costs)
