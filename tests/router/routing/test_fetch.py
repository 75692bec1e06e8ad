"""kv's third choice for a prefix held by a busy replica: place the request elsewhere and
fetch the prefix from the holder's cache, priced in seconds beside queueing at the holder
and recomputing (routing/fetch.py). Taken only where the link makes it cheaper than the
recompute, only between replicas that run a transfer plane, and only for what the chosen
replica does not hold itself."""

from __future__ import annotations

import pytest

from kvroute.events import BlockHasher, BlockStored, EventBatch
from kvroute.events.load import REFERENCE_COEFFICIENTS, LoadReport
from kvroute.router.routing.fetch import DEFAULT_LINK_BYTES_PER_S, FETCH_RTT_S, Holders
from kvroute.router.routing.index import PrefixIndex
from kvroute.router.routing.policy import PREFILL_WORK, KVPolicy, RequestView

BS = 16
HASHER = BlockHasher(block_size=BS)
C = REFERENCE_COEFFICIENTS  # Llama-3.1-8B on an H100: 128 KiB of KV per token
PROMPT = list(range(4096))
FAST = 50e9  # an RDMA-class link: 2.6 us of transfer per token against 36 us of prefill
REPS = ["holder", "idle"]


def hold(index: PrefixIndex, replica: str, tokens: list[int]) -> None:
    hashes = HASHER.hash_blocks(tokens)
    stored = BlockStored(hashes, None, tokens, BS, None, "GPU", None)
    index.apply(replica, EventBatch(0.0, [stored]))


def view(tokens: list[int], rid: str = "q") -> RequestView:
    return RequestView(rid, len(tokens), HASHER.hash_blocks(tokens), BS, tokens, max_tokens=64)


def report(queued: int = 0, link: float = 0.0) -> LoadReport:
    return LoadReport(
        num_waiting=1 if queued else 0, num_running=0, num_decoding=0,
        queued_prefill_tokens=queued, decode_context_tokens=0,
        free_blocks=20_000, total_blocks=20_000, kv_link_bytes_per_s=link,
    )  # fmt: skip


def fleet(queued: int = 200_000, link: float = FAST, fetchable=lambda r: True) -> KVPolicy:
    """``holder`` has the prompt's first 3,072 tokens cached and a long prefill queue;
    ``idle`` holds nothing and waits for nothing."""
    index = PrefixIndex()
    hold(index, "holder", PROMPT[:3072])
    policy = KVPolicy(index, seed=1)
    for r in REPS:
        policy.load.register(r, C, 20_000)
    policy.load.report("holder", report(queued, link), 0.0)
    policy.load.report("idle", report(0, link), 0.0)
    policy.fetchable = fetchable
    return policy


def test_a_busy_holders_prefix_is_fetched_by_an_idle_replica():
    d = fleet().route(view(PROMPT), REPS, 0.0)
    assert (d.replica, d.reason, d.fetch_from, d.fetch_blocks) == ("idle", "fetch", "holder", 192)
    assert d.hit_tokens == 0  # its own cache holds none of it


def test_without_fetch_the_same_request_recomputes_or_queues():
    policy = fleet(fetchable=None)
    policy.fetchable = None
    d = policy.route(view(PROMPT), REPS, 0.0)
    assert d.fetch_from is None and d.reason != "fetch"


def test_an_idle_holder_keeps_its_prefix():
    d = fleet(queued=0).route(view(PROMPT), REPS, 0.0)
    assert d.replica == "holder" and d.fetch_from is None and d.reason == "cache_hit"


def test_a_link_slower_than_the_recompute_is_not_used():
    """At 1 GB/s a token's 128 KiB takes 131 us to move and 36 us to compute on an H100."""
    d = fleet(link=1e9).route(view(PROMPT), REPS, 0.0)
    assert d.fetch_from is None
    assert DEFAULT_LINK_BYTES_PER_S == 1e9  # and an unmeasured link is priced so


def test_only_replicas_with_a_transfer_plane_fetch_or_serve():
    for plane in ("idle", "holder"):  # the other has none
        d = fleet(fetchable=lambda r, p=plane: r == p).route(view(PROMPT), REPS, 0.0)
        assert d.fetch_from is None


def test_the_fetch_is_priced_at_its_bytes_over_the_link():
    """The idle replica's price with the fetch is its recompute's less the prefill (and its
    work) that the fetched tokens spare, plus their transfer; and the route's choice is
    the cheapest of the priced parts."""
    fetching, computing = fleet(), fleet(fetchable=None)
    computing.fetchable = None
    q = view(PROMPT)
    parts = fetching.breakdown(q, REPS, 0.0)
    plain = computing.breakdown(q, REPS, 0.0)["idle"]
    transfer = 3072 * C.kv_bytes_per_token / FAST + FETCH_RTT_S
    assert parts["idle"].fetch == pytest.approx(transfer)
    assert parts["idle"].prefill == pytest.approx(C.prefill_s(1024, 3072))
    spared = (1 + PREFILL_WORK) * (C.prefill_s(4096) - C.prefill_s(1024, 3072))
    assert plain.total - parts["idle"].total == pytest.approx(spared - transfer)
    assert parts["idle"].evict == pytest.approx(plain.evict)  # fetched blocks are new here
    assert parts["holder"].fetch == 0  # it holds the most: nobody to fetch from
    assert min(parts, key=lambda r: parts[r].total) == fetching.route(q, REPS, 0.0).replica


def test_a_replica_holding_part_fetches_only_the_rest():
    policy = fleet()
    hold(policy.index, "idle", PROMPT[:1024])
    d = policy.route(view(PROMPT), REPS, 0.0)
    assert d.replica == "idle" and d.fetch_from == "holder"
    assert d.hit_tokens == 1024 and d.fetch_blocks == 192  # the pull skips what it holds


def test_holders_finds_each_replicas_best_other_holder():
    h = Holders({"a": 9, "b": 4, "c": 7, "x": 12}, lambda r: r != "x")
    assert h.best_for("a") == (7, "c") and h.best_for("b") == (9, "a")
    assert h.best_for("x") == (9, "a")
