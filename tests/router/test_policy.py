"""Routing policies: prefix affinity, load spreading, salts, dead replicas, baselines' rules."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvroute.events import BlockHasher, BlockStored, EventBatch
from kvroute.router.index import PrefixIndex
from kvroute.router.load import LoadTracker
from kvroute.router.policy import (
    POLICIES,
    KVPolicy,
    NoReplicaError,
    RequestView,
    make_policy,
)

BS = 16
HASHER = BlockHasher(block_size=BS)
REPLICAS = [f"replica-{i}" for i in range(4)]


def view(rid: str, tokens: list[int], salt: str | None = None) -> RequestView:
    return RequestView(rid, len(tokens), HASHER.hash_blocks(tokens, cache_salt=salt), BS, tokens)


def hold(index: PrefixIndex, replica: str, tokens: list[int], salt: str | None = None) -> None:
    """The replica's engine reports it cached ``tokens``' full blocks."""
    hashes = HASHER.hash_blocks(tokens, cache_salt=salt)
    ev = BlockStored(hashes, None, tokens[: len(hashes) * BS], BS, None, "GPU", None)
    index.apply(replica, EventBatch(0.0, [ev]))


def prefix(n: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n)]


def test_kv_prefers_the_replica_holding_the_prefix():
    index = PrefixIndex()
    hold(index, "replica-2", prefix(4096))
    policy = KVPolicy(index, seed=1)
    d = policy.route(view("a", prefix(4096) + [7] * 100), REPLICAS, 0.0)
    assert d.replica == "replica-2"
    assert d.hit_tokens == 4096


def test_kv_never_counts_more_than_prompt_minus_one():
    index = PrefixIndex()
    hold(index, "replica-0", prefix(64))
    d = KVPolicy(index).route(view("a", prefix(64)), REPLICAS, 0.0)
    assert d.replica == "replica-0" and d.hit_tokens == 48  # 63 tokens -> 3 full blocks


def test_salted_tenant_never_matches_another_tenants_blocks():
    index = PrefixIndex()
    hold(index, "replica-1", prefix(2048), salt="tenant-a")
    policy = KVPolicy(index, seed=3)
    other = view("b", prefix(2048) + [1] * 50, salt="tenant-b")
    assert index.match(other.block_hashes) == {}
    costs = policy.costs(other, REPLICAS, 0.0)
    assert len(set(costs.values())) == 1  # no replica looks cheaper to tenant b
    assert policy.route(other, REPLICAS, 0.0).hit_tokens == 0
    policy.on_finished("b", 0.0)  # so load does not steer the next one
    same = view("a", prefix(2048) + [1] * 50, salt="tenant-a")
    assert policy.route(same, REPLICAS, 0.0).replica == "replica-1"


@pytest.mark.parametrize("name", POLICIES)
def test_a_dead_replica_is_never_chosen(name):
    index = PrefixIndex()
    hold(index, "replica-3", prefix(4096))  # the dead one holds everything
    policy = make_policy(name, index=index, block_size=BS, seed=5)
    alive = REPLICAS[:3]
    for i in range(200):
        d = policy.route(view(f"r{i}", prefix(4096) + [i] * 40), alive, float(i))
        assert d.replica in alive
        if i % 3 == 0:
            policy.on_finished(f"r{i}", float(i))
    with pytest.raises(NoReplicaError):
        policy.route(view("x", prefix(64)), [], 0.0)


def test_hot_prefix_spreads_instead_of_overloading_its_holder():
    """A replica's queue may exceed the others' by at most what a hit saves, over the prefill
    weight: past that, siblings go elsewhere (and warm the prefix there)."""
    index = PrefixIndex()
    hold(index, "replica-0", prefix(8192))
    policy = KVPolicy(index, seed=7)
    n = 1500
    got = Counter(
        policy.route(view(f"r{i}", prefix(8192) + [i] * 256), REPLICAS, 0.0).replica
        for i in range(n)
    )  # a burst: nothing finishes, every request queues its prefill
    assert set(got) == set(REPLICAS)
    assert max(got.values()) < 0.4 * n
    queued = [policy.load.get(r, 0.0)[0] for r in REPLICAS]
    assert max(queued) - min(queued) <= 8192 / policy.prefill_weight + 8192 + 256


def test_kv_choose_is_the_documented_rule_draw_for_draw():
    """``choose`` (one pass, no per-replica tuples) picks what the rule says -- lowest cost
    as ``costs`` reports it, then fewest in flight, then a seeded coin over the tied in
    replica order -- the same replica, draw for draw, as a policy seeded alike would by
    computing every cost first, and credits the chosen replica's own hit."""
    rng = random.Random(3)
    index = PrefixIndex()
    replicas = [f"replica-{i}" for i in range(10)]
    prompts = [prefix(1024, base=100_000 * i) for i in range(4)]  # the 4th held nowhere
    for i, r in enumerate(replicas[:6]):
        hold(index, r, prompts[i % 3][: 256 * (1 + i % 4)])
    policy = KVPolicy(index, seed=9, prefill_weight=0.25, decode_weight=0.01)
    coin = KVPolicy(index, seed=9).rng  # the same seeded coin, drawn by the reference
    kinds: Counter = Counter()
    flights: list[str] = []
    for k in range(300):
        if rng.random() < 0.6:  # often a quiet fleet, where costs tie
            for f in flights:
                policy.load.on_finished(f)
            flights.clear()
        for r in rng.sample(replicas, rng.randint(0, 3)):
            flights.append(f"l{k}{r}")  # prefill 0: a count apart at equal cost
            policy.load.on_routed(flights[-1], r, rng.choice([0, 0, 64]), 256)
            if rng.random() < 0.2:
                policy.load.on_first_token(flights[-1])
        if k % 7 == 0:
            policy.load.report(rng.choice(replicas), 4096, 0, 3, now=float(k))
        req = view(f"q{k}", rng.choice(prompts)[: rng.choice([16, 300, 1024])] + [k] * 40)
        costs = policy.costs(req, replicas, float(k))
        key = {r: (costs[r], policy.load.get(r, float(k))[2]) for r in replicas}
        best = min(key.values())
        tied = [r for r in replicas if key[r] == best]
        want = tied[0] if len(tied) == 1 else coin.choice(tied)
        got = policy.choose(req, replicas, float(k))
        held = index.match(req.block_hashes[: (req.num_prompt_tokens - 1) // BS])
        assert (got.replica, got.hit_tokens) == (want, held.get(want, 0) * BS), k
        kinds["tied" if len(tied) > 1 else "alone"] += 1
        kinds["hit" if got.hit_tokens else "miss"] += 1
        kinds["count broke a cost tie"] += sum(c == best[0] for c, _ in key.values()) > len(tied)
    for kind in ("alone", "tied", "hit", "miss", "count broke a cost tie"):
        assert kinds[kind] > 10, kinds  # every branch of the rule was exercised


def test_kv_follows_siblings_before_any_event_arrives():
    index = PrefixIndex()
    policy = KVPolicy(index, seed=11, prefill_weight=0.0)
    first = policy.route(view("a", prefix(4096) + [1] * 32), REPLICAS, 0.0)
    for i in range(20):
        d = policy.route(view(f"s{i}", prefix(4096) + [i + 2] * 32), REPLICAS, 0.5)
        assert d.replica == first.replica and d.hit_tokens == 4096
    # predictions expire: with no events confirming them, the prefix is forgotten
    assert policy.route(view("late", prefix(4096)), REPLICAS, 60.0).hit_tokens == 0


def test_least_loaded_and_round_robin():
    rr = make_policy("round_robin")
    assert [rr.route(view(f"r{i}", prefix(32)), REPLICAS, 0.0).replica for i in range(8)] == (
        REPLICAS * 2
    )
    ll = make_policy("least_loaded", seed=2)
    for i in range(40):
        ll.route(view(f"r{i}", prefix(32)), REPLICAS, 0.0)
    assert {ll.load.get(r, 0.0)[2] for r in REPLICAS} == {10}


def test_approx_text_follows_its_tree_until_imbalance_then_balances():
    policy = make_policy("approx_text", block_size=BS, seed=4)
    first = policy.route(view("a", prefix(1024)), REPLICAS, 0.0).replica
    # 0.5 of the prompt matches (> 0.3): sticks to the same replica regardless of salt
    d = policy.route(view("b", prefix(1024) + [9] * 1024, salt="other"), REPLICAS, 0.0)
    assert d.replica == first
    # no match: the replica with the smallest tree (not `first`)
    assert policy.route(view("c", [5] * 512), REPLICAS, 0.0).replica != first
    # pile load on `first` past both thresholds (> 64 apart and > 1.5x): it is avoided
    for i in range(100):
        policy.load.on_routed(f"x{i}", first, 10, 10)
    assert policy.route(view("d", prefix(1024)), REPLICAS, 0.0).replica != first


def test_load_tracker_accounting_and_reports():
    t = LoadTracker(report_ttl_s=1.0)
    t.on_routed("a", "r", 1000, 1200)
    t.on_routed("b", "r", 500, 600)
    assert t.get("r", 0.0) == (1500, 0, 2)
    t.on_first_token("a")
    assert t.get("r", 0.0) == (500, 1200, 2)
    t.on_finished("a")
    t.on_finished("a")  # twice is harmless
    assert t.get("r", 0.0) == (500, 0, 1)
    t.report("r", 9000, 0, 5, now=10.0)
    assert t.get("r", 10.5) == (9000, 0, 5)
    assert t.get("r", 11.5) == (500, 0, 1)  # stale report ignored
    assert t.drop_replica("r") == ["b"] and t.get("r", 0.0) == (0, 0, 0)
