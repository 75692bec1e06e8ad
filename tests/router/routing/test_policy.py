"""Routing policies: prefix affinity, load spreading, salts, dead replicas, baselines' rules."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import msgspec
import pytest

from kvroute.events import BlockHasher, BlockStored, EventBatch
from kvroute.events.load import REFERENCE_COEFFICIENTS, LoadReport
from kvroute.router.routing.index import PrefixIndex
from kvroute.router.routing.load import LoadTracker
from kvroute.router.routing.policies import POLICIES, make_policy
from kvroute.router.routing.policy import (
    DECODE_OVERLAP,
    KVPolicy,
    NoReplicaError,
    RequestView,
    evicted_reuse,
    price,
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


def test_a_request_that_reads_no_cache_is_priced_as_a_miss_everywhere():
    """Asking for its prompt's logprobs, a request computes every token wherever it goes:
    the holder saves it nothing, so it is routed as a miss (and the blocks it will store
    are still predicted on the replica chosen)."""
    index = PrefixIndex()
    hold(index, "replica-2", prefix(4096))
    policy = KVPolicy(index, seed=1)
    req = dataclasses.replace(view("a", prefix(4096) + [7] * 100), reads_cache=False)
    costs = policy.costs(req, REPLICAS, 0.0)
    assert len(set(costs.values())) == 1  # the holder's price is every idle replica's
    d = policy.route(req, REPLICAS, 0.0)
    assert d.hit_tokens == 0 and d.reason != "cache_hit"
    follower = policy.route(view("b", prefix(4096) + [8] * 100), [d.replica], 0.0)
    assert follower.hit_tokens == 4096  # predicted: it is stored where it went


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
    policy = KVPolicy(index, seed=9)
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
            policy.load.report(rng.choice(replicas), report(4096, 0, 0, 3), now=float(k))
        req = view(f"q{k}", rng.choice(prompts)[: rng.choice([16, 300, 1024])] + [k] * 40)
        costs = policy.costs(req, replicas, float(k))
        key = {r: (costs[r], policy.load.get(r, float(k))[3]) for r in replicas}
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
    policy = KVPolicy(index, seed=11)
    first = policy.route(view("a", prefix(4096) + [1] * 32), REPLICAS, 0.0)
    policy.on_first_token("a", 0.3)  # its prefill is done; its BlockStored not yet in
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
    assert {ll.load.get(r, 0.0)[3] for r in REPLICAS} == {10}


def test_approx_text_follows_its_tree_until_imbalance_then_balances():
    policy = make_policy("approx_text", block_size=BS, seed=4)
    first = policy.route(view("a", prefix(1024)), REPLICAS, 0.0).replica
    # 0.5 of the prompt matches (> 0.3): sticks to the same replica
    d = policy.route(view("b", prefix(1024) + [9] * 1024), REPLICAS, 0.0)
    assert d.replica == first
    # no match: the replica with the smallest tree (not `first`)
    assert policy.route(view("c", [5] * 512), REPLICAS, 0.0).replica != first
    # pile load on `first` past both thresholds (> 64 apart and > 1.5x): it is avoided
    for i in range(100):
        policy.load.on_routed(f"x{i}", first, 10, 10)
    assert policy.route(view("d", prefix(1024)), REPLICAS, 0.0).replica != first


def test_approx_text_keeps_tenants_apart():
    """Another tenant's salt (another tenant) never matches the first one's tree: its
    request goes where an unmatched one would, not to the holder of the same text."""
    policy = make_policy("approx_text", block_size=BS, seed=4)
    first = policy.route(view("a", prefix(1024), salt="tenant-a"), REPLICAS, 0.0).replica
    same = policy.route(view("b", prefix(1024), salt="tenant-a"), REPLICAS, 0.0).replica
    assert same == first
    for i, salt in enumerate(("tenant-b", "tenant-c", None)):
        d = policy.route(view(f"o{i}", prefix(1024), salt=salt), REPLICAS, 0.0)
        assert d.replica != first  # unmatched: the smallest tree, never the holder's


def report(queued: int, context: int, decoding: int, requests: int, free: int = 1000):
    return LoadReport(
        num_waiting=requests - decoding,
        num_running=decoding,
        num_decoding=decoding,
        queued_prefill_tokens=queued,
        decode_context_tokens=context,
        free_blocks=free,
        total_blocks=1000,
    )


def test_load_tracker_accounting_and_reports():
    t = LoadTracker(report_ttl_s=1.0)
    t.register("r", REFERENCE_COEFFICIENTS, total_blocks=1000)
    t.on_routed("a", "r", 1000, 1200, blocks=80)
    t.on_routed("b", "r", 500, 600, blocks=40)
    assert t.get("r", 0.0) == (1500, 0, 0, 2, 880, 1000)
    t.on_first_token("a")
    assert t.get("r", 0.0) == (500, 1200, 1, 2, 880, 1000)
    t.on_finished("a", output_tokens=100)
    t.on_finished("a")  # twice is harmless
    assert t.get("r", 0.0) == (500, 0, 0, 1, 960, 1000)
    t.report("r", report(9000, 50_000, 3, 5, free=700), now=10.0)
    assert t.get("r", 10.5) == (9000, 50_000, 3, 5, 700, 1000)
    t.on_routed("c", "r", 100, 100, blocks=25)  # placed after the report: not in its figures
    assert t.get("r", 10.5) == (9000, 50_000, 3, 5, 675, 1000)  # counts: the larger figure
    assert t.get("r", 11.5) == (600, 0, 0, 2, 935, 1000)  # stale report ignored
    assert sorted(t.drop_replica("r")) == ["b", "c"]
    assert t.get("r", 0.0) == (0, 0, 0, 0, 1000, 1000)  # coefficients and size survive a drop
    unknown = LoadTracker()
    unknown.on_routed("x", "new", 100, 100, blocks=5)
    assert unknown.get("new", 0.0)[4:] == (1 << 40, 0)  # size not known yet: total 0
    assert t.coefficients("r") is REFERENCE_COEFFICIENTS


def test_expected_output_learns_from_finished_requests():
    t = LoadTracker(prior_output_tokens=256)
    assert t.expected_output_tokens() == 256
    for i in range(92):
        t.on_routed(f"x{i}", "r", 10, 10)
        t.on_finished(f"x{i}", output_tokens=16)
    assert t.expected_output_tokens() == pytest.approx((8 * 256 + 92 * 16) / 100)
    assert t.expected_output_tokens(max_tokens=8) == 8  # a request's own cap wins


# -- the kv cost, one part at a time ---------------------------------------------------------
C = REFERENCE_COEFFICIENTS
IDLE = (0, 0, 0, 0, 10_000, 0)  # KV size not reported: an eviction is one recompute


def test_cost_queued_prefill_is_waited_out_at_the_replicas_prefill_rate():
    quiet, queued = (
        price(C, IDLE, 1000, 0, 100, BS),
        price(C, (50_000, 0, 0, 3, 10_000, 0), 1000, 0, 100, BS),
    )
    assert quiet.wait == 0 and queued.wait == pytest.approx(50_000 * C.prefill_s_per_token)
    assert queued._replace(wait=0) == quiet  # nothing else moved


def test_cost_prefill_counts_only_uncached_tokens_with_the_quadratic_term():
    cold, warm = price(C, IDLE, 8192, 0, 100, BS), price(C, IDLE, 8192, 8000, 100, BS)
    assert cold.prefill == pytest.approx(C.prefill_s(8192))
    assert warm.prefill == pytest.approx(C.prefill_s(192, 8000))
    assert cold.prefill > warm.prefill * 20
    # attention is quadratic: twice the prompt costs more than twice the time
    assert C.prefill_s(16_384) > 2 * C.prefill_s(8192)


def test_cost_decode_grows_with_the_context_the_replica_is_decoding():
    light = price(C, (0, 10_000, 4, 4, 10_000, 0), 1000, 0, 200, BS)
    heavy = price(C, (0, 400_000, 4, 4, 10_000, 0), 1000, 0, 200, BS)
    # memory-bound: the overlapped share of the extra context is read at every one of its steps
    extra = 200 * DECODE_OVERLAP * 390_000 * C.kv_read_s_per_token
    assert heavy.decode - light.decode == pytest.approx(extra)
    assert (heavy.wait, heavy.prefill, heavy.capacity) == (light.wait, light.prefill, 0.0)


def test_cost_eviction_prices_the_blocks_a_miss_displaces():
    cold, warm = price(C, IDLE, 4096, 0, 100, BS), price(C, IDLE, 4096, 4000, 100, BS)
    assert cold.evict == pytest.approx(4096 * C.prefill_s_per_token)
    assert warm.evict == pytest.approx(96 * C.prefill_s_per_token)


def test_cost_eviction_grows_with_the_share_of_the_cache_committed_to_live_work():
    """R = U / (T - U) recomputes per evicted token, U the blocks committed (held by running
    requests, placed since the last report, taken by this request), T the cache."""
    t, n, out = 10_000, 4096, 100
    new = -(-(n + out) // BS)  # this request's blocks
    one = n * C.prefill_s_per_token  # one recompute of what it evicts

    def evict(free: int) -> float:
        return price(C, (0, 0, 0, 0, free, t), n, 0, out, BS).evict

    assert evicted_reuse(t, t, 0) == 0.0  # an empty cache: nothing anyone wants is lost
    assert evict(t) == pytest.approx(one * new / (t - new))  # only its own blocks: ~0.03
    assert evict(t // 2 + new) == pytest.approx(one)  # half committed: the old constant
    assert evict(t // 5 + new) == pytest.approx(4 * one)  # 4/5 committed: 4 recomputes
    # monotone in pressure, finite when nothing is left (floored at one block)
    prices = [evict(free) for free in range(t, -100, -250)]
    assert prices == sorted(prices) and prices[-1] == pytest.approx(one * (t - 1))
    # a hit needs fewer new blocks and evicts only its uncached tokens
    warm = price(C, (0, 0, 0, 0, t // 2 + new, t), n, 4000, out, BS).evict
    left = t // 2 + new - (new - 4000 // BS)
    assert warm == pytest.approx(96 * C.prefill_s_per_token * (t - left) / left)


def _fleet_with_a_holder(free: int, holder_queue: int) -> tuple[KVPolicy, RequestView]:
    """Four replicas of 10,000 blocks, each reporting ``free`` of them unheld; replica-0
    holds the request's 2,048-token prefix and has ``holder_queue`` prompt tokens queued."""
    index = PrefixIndex()
    hold(index, "replica-0", prefix(2048))
    policy = KVPolicy(index, seed=2)
    for r in REPLICAS:
        policy.load.register(r, C, 10_000)
        queued = holder_queue if r == "replica-0" else 0
        rep = msgspec.structs.replace(report(queued, 0, 0, 1, free), total_blocks=10_000)
        policy.load.report(r, rep, now=0.0)
    return policy, view("q", prefix(2048) + [9] * 2048)


def test_at_low_pressure_a_loaded_holder_loses_the_request_to_an_idle_replica():
    """Caches nearly empty of live work: evicting costs almost nothing, so the hit is
    worth only its prefill, counted twice (the request's own time and the delay of the
    requests served after it there), and a queue at the holder longer than that sends the
    request to an idle replica. With one recompute per evicted token at any pressure (the
    old constant) the holder's 2,048 cached tokens were worth more and it kept it."""
    saved_prefill = C.prefill_s(2048 + 2048) - C.prefill_s(2048, 2048)
    queue = int(2.5 * saved_prefill / C.prefill_s_per_token)  # 2.5x the prefill saved
    assert 2.5 * saved_prefill < 2 * saved_prefill + 2048 * C.prefill_s_per_token  # old
    policy, req = _fleet_with_a_holder(free=9_900, holder_queue=queue)
    parts = policy.breakdown(req, REPLICAS, 0.1)
    assert parts["replica-1"].evict < 0.05 * 4096 * C.prefill_s_per_token
    assert policy.route(req, REPLICAS, 0.1).replica != "replica-0"


def test_a_prefill_counts_twice_so_a_holder_keeps_a_turn_its_hit_saves_more_than_waits():
    """The work term: a queue at the holder that costs 1.5x the prefill its hit saves
    sent the request away while kv priced the prefill as its own time alone; the prefill
    it would add elsewhere also delays the requests after it there, so now the holder
    keeps it. Each part is the request's compute, not its load: the term is the prefill."""
    saved_prefill = C.prefill_s(2048 + 2048) - C.prefill_s(2048, 2048)
    queue = int(1.5 * saved_prefill / C.prefill_s_per_token)
    policy, req = _fleet_with_a_holder(free=9_900, holder_queue=queue)
    parts = policy.breakdown(req, REPLICAS, 0.1)
    for p in parts.values():
        assert p.work == pytest.approx(p.prefill)
    moved = parts["replica-1"].total - parts["replica-1"].work
    held = parts["replica-0"].total - parts["replica-0"].work
    assert moved < held  # priced as its own time alone, it would leave its holder
    assert policy.route(req, REPLICAS, 0.1).replica == "replica-0"


def test_at_high_pressure_the_holder_keeps_its_prefix_despite_its_queue():
    """Caches mostly committed to live work: a miss evicts prefixes that will be wanted
    again, and each recompute evicts another, so copying the prefix elsewhere costs far
    more than its prefill. The same queue at the holder -- and one three times as long,
    which the old constant price sent elsewhere -- no longer moves the request."""
    saved_prefill = C.prefill_s(2048 + 2048) - C.prefill_s(2048, 2048)
    queue = int(3 * saved_prefill / C.prefill_s_per_token)
    assert 3 * saved_prefill > saved_prefill + 2048 * C.prefill_s_per_token  # old: moved
    policy, req = _fleet_with_a_holder(free=1_500, holder_queue=queue)
    parts = policy.breakdown(req, REPLICAS, 0.1)
    assert parts["replica-1"].evict > 5 * 4096 * C.prefill_s_per_token
    assert policy.route(req, REPLICAS, 0.1).replica == "replica-0"


def test_a_miss_goes_to_the_replica_with_the_most_cache_to_spare():
    """Equal queues, no hit anywhere: the miss lands where evicting costs least, the
    replica whose cache is least committed."""
    for seed in range(8):  # not a coin's luck
        policy = KVPolicy(PrefixIndex(), seed=seed)
        for r, free in zip(REPLICAS, (2_000, 6_000, 3_000, 2_500), strict=True):
            policy.load.register(r, C, 10_000)
            rep = msgspec.structs.replace(report(0, 0, 0, 1, free), total_blocks=10_000)
            policy.load.report(r, rep, now=0.0)
        assert policy.route(view("m", [5] * 3000), REPLICAS, 0.1).replica == "replica-1"


def test_cost_capacity_prices_preemption_only_when_free_blocks_run_short():
    need = -(-(1000 + 200) // BS)
    roomy = price(C, (0, 0, 0, 0, need, 0), 1000, 0, 200, BS)
    tight = price(C, (0, 0, 0, 0, need - 10, 0), 1000, 0, 200, BS)
    assert roomy.capacity == 0.0
    assert tight.capacity == pytest.approx(2 * C.prefill_s(10 * BS))
    # a hit needs fewer new blocks: the same replica has room for a request it holds
    assert price(C, (0, 0, 0, 0, need - 10, 0), 1000, 512, 200, BS).capacity == 0.0


def test_a_slower_replica_is_priced_in_its_own_seconds():
    """A mixed fleet needs no flag: a replica whose coefficients are 3x slower still gets
    work from a burst of cold requests, but less than a third, since its queue drains 3x
    slower and each request decodes 3x slower there."""
    slow = msgspec.structs.replace(
        C,
        prefill_s_per_token=3 * C.prefill_s_per_token,
        attention_s_per_pair=3 * C.attention_s_per_pair,
        weights_read_s=3 * C.weights_read_s,
        kv_read_s_per_token=3 * C.kv_read_s_per_token,
    )
    policy = KVPolicy(PrefixIndex(), seed=1)
    policy.load.register("fast", C, 10_000)
    policy.load.register("slow", slow, 10_000)
    got = Counter(
        policy.route(view(f"r{i}", [i] * 2048), ["fast", "slow"], 0.0).replica for i in range(80)
    )
    assert got["slow"] > 0 and got["fast"] >= 3 * got["slow"], got


def test_reference_coefficients_are_the_h100_8b_profile():
    """The router's fallback for a replica that reports none is the simulator's profile."""
    from kvroute.replica.model.cost_model import H100_8B, CostModel

    ref = CostModel(H100_8B).coefficients()
    for field in ref.__struct_fields__:
        if field != "source":
            assert getattr(REFERENCE_COEFFICIENTS, field) == pytest.approx(getattr(ref, field))
