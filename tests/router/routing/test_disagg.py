"""Whether a request splits into prefill and decode, and where each part may go.

The rule (router/routing/disagg.py): a request splits only when the cheapest split costs
fewer seconds than running it whole on the best replica that decodes, the whole run
charged the stall its prefill puts on that replica's decoders. So a long prompt headed
for a replica full of decoders splits; a short or cached prompt, or an idle decode
replica, stays whole; a policy that does not price splits everything splittable.
"""

from __future__ import annotations

import msgspec
import pytest

from kvroute.events import BlockHasher
from kvroute.events.load import REFERENCE_COEFFICIENTS, LoadReport
from kvroute.events.replica_api import GenerateRequest, Resume, SamplingParams
from kvroute.router.routing.disagg import Part, best_pair, plan, route_decode, split_pays
from kvroute.router.routing.index import PrefixIndex
from kvroute.router.routing.load import LoadTracker
from kvroute.router.routing.policies import make_policy
from kvroute.router.routing.policy import RequestView

BS = 16
ROLES = {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode"}
HASHER = BlockHasher("xxh3_128", "seed", BS)


def role(r: str) -> str:
    return ROLES.get(r, "both")


def fleet(decoding: dict[str, int]):  # type: ignore[no-untyped-def]
    """A kv policy over p0, p1, d0, d1 (h100-8b's coefficients), ``decoding[r]`` requests
    decoding at r with 2,000 tokens of context each."""
    index = PrefixIndex()
    load = LoadTracker()
    for r in ROLES:
        load.register(r, REFERENCE_COEFFICIENTS, 20_000)
        n = decoding.get(r, 0)
        report = LoadReport(
            num_waiting=0, num_running=n, num_decoding=n, queued_prefill_tokens=0,
            decode_context_tokens=2000 * n, free_blocks=20_000 - 125 * n, total_blocks=20_000,
        )  # fmt: skip
        load.report(r, report, 0.0)
    return make_policy("kv", index=index, block_size=BS, load=load), index


def view(n: int, out: int = 200) -> RequestView:
    tokens = list(range(1, n + 1))
    return RequestView("r", n, HASHER.hash_blocks(tokens), BS, max_tokens=out)


def request(n: int, **sp: object) -> GenerateRequest:
    params = SamplingParams(**{"max_tokens": 200, **sp})  # type: ignore[arg-type]
    return GenerateRequest(request_id="r", prompt_token_ids=list(range(1, n + 1)), sampling=params)


def test_long_prompt_onto_busy_decoders_splits() -> None:
    policy, _ = fleet({"d0": 64, "d1": 64})
    assert split_pays(view(8000), policy, ["p0", "p1"], ["d0", "d1"], 0.0)


def test_short_prompt_stays_whole() -> None:
    policy, _ = fleet({"d0": 64, "d1": 64})
    assert not split_pays(view(40), policy, ["p0", "p1"], ["d0", "d1"], 0.0)


def test_idle_decode_replica_keeps_a_long_prompt_whole() -> None:
    policy, _ = fleet({})
    assert not split_pays(view(8000), policy, ["p0"], ["d0"], 0.0)


def test_prompt_cached_on_the_decode_replica_stays_whole() -> None:
    """Its prefill is almost free there: nothing worth a handoff."""
    policy, index = fleet({"d0": 64})
    v = view(8000)
    index.predict("d0", list(v.block_hashes), 60.0, 0.0)
    assert not split_pays(v, policy, ["p0"], ["d0"], 0.0)
    assert split_pays(v, fleet({"d0": 64})[0], ["p0"], ["d0"], 0.0)  # the same, uncached


def test_busy_prefill_pool_keeps_a_request_whole() -> None:
    """A prefill replica with a long queue costs more than the stall it would spare."""
    policy, _ = fleet({"d0": 8})
    busy = LoadReport(
        num_waiting=40, num_running=4, num_decoding=0, queued_prefill_tokens=400_000,
        decode_context_tokens=0, free_blocks=10_000, total_blocks=20_000,
    )  # fmt: skip
    policy.load.report("p0", busy, 0.0)
    assert not split_pays(view(4000), policy, ["p0"], ["d0"], 0.0)


def test_plan_parts() -> None:
    policy, _ = fleet({"d0": 64, "d1": 64})
    all4 = list(ROLES)
    long_req, v = request(8000), view(8000)
    assert plan(long_req, all4, role, decoding=False, view=v, policy=policy) == Part(
        ["p0", "p1"], True
    )
    short = plan(request(40), all4, role, decoding=False, view=view(40), policy=policy)
    assert short == Part(["d0", "d1"], False)  # whole, on a replica that decodes
    # without a price (a baseline policy, or pd_split=always): every splittable request
    assert plan(request(40), all4, role, decoding=False) == Part(["p0", "p1"], True)
    # after the first token: a replica that decodes
    assert plan(long_req, all4, role, decoding=True) == Part(["d0", "d1"], False)


@pytest.mark.parametrize(
    "req",
    [
        request(8000, max_tokens=1),
        request(8000, prompt_logprobs=1),
        GenerateRequest(
            request_id="r",
            prompt_token_ids=list(range(8000)),
            resume=Resume(output_token_ids=[5]),
        ),
    ],
    ids=["one_token", "prompt_logprobs", "resumed"],
)
def test_unsplittable_requests_run_whole(req: GenerateRequest) -> None:
    part = plan(req, list(ROLES), role, decoding=False)
    assert not part.handoff and set(part.candidates) == {"d0", "d1"}


def test_unified_fleet_never_splits() -> None:
    part = plan(request(8000), ["a", "b"], lambda r: "both", decoding=False)
    assert part == Part(["a", "b"], False)


def test_slow_reported_link_keeps_a_request_whole() -> None:
    """The decode replica's measured link (LoadReport.kv_link_bytes_per_s) prices the
    transfer: over a slow one, moving the prompt costs more than the stall it spares."""
    policy, _ = fleet({"d0": 64})
    assert split_pays(view(8000), policy, ["p0"], ["d0"], 0.0)
    report = policy.load.last_report("d0")
    slow = msgspec.structs.replace(report, kv_link_bytes_per_s=1e7)  # 10 MB/s
    policy.load.report("d0", slow, 0.0)
    assert not split_pays(view(8000), policy, ["p0"], ["d0"], 0.0)


def both(r: str) -> str:
    return "both"


def fast_link(policy, *replicas: str) -> None:  # type: ignore[no-untyped-def]
    """Their reports say their pulls took 50 GB/s (an H100 node's NIC)."""
    for r in replicas:
        report = policy.load.last_report(r)
        policy.load.report(r, msgspec.structs.replace(report, kv_link_bytes_per_s=50e9), 0.0)


def test_pair_splits_a_cached_prompt_off_its_crowded_holder() -> None:
    """On a fleet of both (pair=True): p0 holds the prompt but decodes 64 streams, d0 is
    idle and holds nothing. Computing the prompt again at d0 or decoding in p0's batch
    both cost more than prefilling at p0 (a hit) and pulling to d0."""
    policy, index = fleet({"p0": 64, "p1": 64, "d1": 64})
    fast_link(policy, *ROLES)
    v = view(8000)
    index.predict("p0", list(v.block_hashes), 60.0, 0.0)
    part = plan(request(8000), list(ROLES), both, decoding=False, view=v, policy=policy, pair=True)
    assert part == Part(["p0"], True, "d0")
    # the same fleet without pair (the default): one pass, whole, as before
    plain = plan(request(8000), list(ROLES), both, decoding=False, view=v, policy=policy)
    assert plain == Part(list(ROLES), False)
    # after the first token, or unsplittable: whole, anywhere
    assert plan(request(8000), list(ROLES), both, decoding=True, pair=True) == plain
    one = request(8000, max_tokens=1)
    assert plan(one, list(ROLES), both, decoding=False, view=v, policy=policy, pair=True) == plain


def test_pair_stays_whole_where_no_split_pays() -> None:
    """An idle fleet of both, or a link that is slow: nothing to spare, the policy's choice."""
    policy, index = fleet({})
    fast_link(policy, *ROLES)
    v = view(8000)
    index.predict("p0", list(v.block_hashes), 60.0, 0.0)
    assert best_pair(v, policy, list(ROLES), 0.0) is None
    crowded, index = fleet({"p0": 64, "p1": 64, "d1": 64})
    index.predict("p0", list(v.block_hashes), 60.0, 0.0)  # links unreported: 1 GB/s
    assert best_pair(v, crowded, list(ROLES), 0.0) is None


def test_pair_never_pairs_a_replica_with_itself() -> None:
    policy, _ = fleet({"p1": 64, "d0": 64, "d1": 64})  # p0: idle, cheapest for both parts
    fast_link(policy, *ROLES)
    v = view(8000)
    chosen = best_pair(v, policy, ["p0", "d0"], 0.0)
    assert chosen is None or chosen[0] != chosen[1]
    assert best_pair(v, policy, ["p0"], 0.0) is None  # one replica: no pair


def test_pair_always_splits_without_a_price() -> None:
    """pair with a policy that does not price (or pd_split=always): every splittable
    request splits, its decode left to the caller (any replica but the prefill one)."""
    assert plan(request(8000), ["a", "b"], both, decoding=False, pair=True) == Part(
        ["a", "b"], True
    )
    assert plan(request(8000), ["a"], both, decoding=False, pair=True) == Part(["a"], False)


def test_pair_on_pools_runs_whole_requests_anywhere() -> None:
    """Pools with pair=True: a request that does not split may run on a prefill replica
    too (the policy's choice among all), where plain pools keep it on the decoders."""
    policy, index = fleet({"d0": 64, "d1": 64})
    fast_link(policy, *ROLES)
    short = plan(request(40), list(ROLES), role, decoding=False, view=view(40), policy=policy,
                 pair=True)  # fmt: skip
    assert short == Part(list(ROLES), False)
    # an idle prefill replica is the cheapest whole run too: no reason to split
    v = view(8000)
    long_req = plan(request(8000), list(ROLES), role, decoding=False, view=v, policy=policy,
                    pair=True)  # fmt: skip
    assert long_req == Part(list(ROLES), False)
    # the prompt cached at p0, whose whole requests crowd it; d0 idle: prefill there, pull
    policy, index = fleet({"p0": 64, "p1": 64, "d1": 64})
    fast_link(policy, *ROLES)
    index.predict("p0", list(v.block_hashes), 60.0, 0.0)
    long_req = plan(request(8000), list(ROLES), role, decoding=False, view=v, policy=policy,
                    pair=True)  # fmt: skip
    assert long_req == Part(["p0", "p1"], True)
    # the decode part still goes to the replicas that decode
    assert plan(request(8000), list(ROLES), role, decoding=True, pair=True) == Part(
        ["d0", "d1"], False
    )


def test_route_decode_books_only_the_tail() -> None:
    """A decode part pulls its prompt's full blocks: its replica's queued prefill grows by
    the tail it computes, not by the prompt (Policy.route alone books all 8,000)."""
    policy, _ = fleet({})
    v = view(8000 + 5)  # 500 full blocks and 5 tokens
    route_decode(policy, v, ["d0"], 0.0, lease_tokens=8000)
    assert policy.load.get("d0", 0.0)[0] == 5
    plain, _ = fleet({})
    plain.route(v, ["d0"], 0.0)
    assert plain.load.get("d0", 0.0)[0] == 8005
