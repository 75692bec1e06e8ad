"""Prefix fetch: a request on one engine pulls its prefix from another engine's cache.

Why it matters: the holder computed that prefix for other requests and leased nothing; the
puller names the blocks by hash and the holder pins what it still holds, for the pull's
length only (kv_transfer/leases.py, ``Leases.pin``). Whatever the holder still has -- all of
it, part of it, none (evicted, or another tenant's hashes), or no answer in time -- the
request's tokens equal one engine's alone, the holder ends with no pin, and the puller's
KV events replay to exactly its cache.

The engines share a process and pull through :class:`LocalLink`; hand-stepped, the holder
has no engine thread, so its wake-up polls its leases as the async engine's thread would.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvroute.events.kv_transfer import KVSource
from kvroute.replica.engine.llm_engine import LLMEngine
from kvroute.replica.kv_transfer import sender as sender_module

from .test_pd_exactness import (
    BS,
    GREEDY,
    SEEDED,
    Pair,
    Result,
    drive,
    make_pair,
    prompt,
    run_unified,
    settle,
)


@pytest.fixture(scope="module")
def pair() -> Pair:
    pair = make_pair()
    leases = pair.p.scheduler.leases
    assert leases is not None
    leases.wake = leases.poll  # an idle holder's engine thread, woken for the pin
    return pair


@pytest.fixture(scope="module")
def unified() -> LLMEngine:
    from kvroute.replica.engine.config import EngineConfig

    return LLMEngine(EngineConfig(model="tiny", num_blocks=96))


def fetch(pair: Pair, ids: list[int], num_blocks: int, params: Any = GREEDY, **kw: Any) -> Result:
    """The request on ``pair.d``, its first ``num_blocks`` blocks fetched from ``pair.p``."""
    source = KVSource(replica_id="p", endpoint="", lease=b"", num_blocks=num_blocks)
    rid = f"f{len(ids)}-{id(source)}"
    pair.d.add_request(rid, ids, params, kv_source=source, **kw)
    return drive(pair.d, rid)


def check(pair: Pair, unified: LLMEngine, ids: list[int], blocks: int, **kw: Any) -> Result:
    ref = run_unified(unified, ids, GREEDY, **kw)
    got = fetch(pair, ids, blocks, GREEDY, **kw)
    assert got.token_ids == ref.token_ids and got.text == ref.text
    assert got.finish_reason == ref.finish_reason
    settle(pair)
    return got


def test_a_prefix_held_elsewhere_is_fetched_whole(pair: Pair, unified: LLMEngine) -> None:
    ids = prompt(150, 101)
    run_unified(pair.p, ids[:130], GREEDY)  # the holder served the prefix (8 full blocks)
    settle(pair)
    fetches = pair.p.kv_sender.stats["fetches"]  # type: ignore[union-attr]
    got = check(pair, unified, ids, 8)
    assert got.remote_tokens == 8 * BS  # every block fetched; the rest computed here
    assert pair.p.kv_sender.stats["fetches"] == fetches + 1  # type: ignore[union-attr]
    assert pair.p.scheduler.leases.stats["pinned"] >= 1  # type: ignore[union-attr]


def test_only_what_the_holder_still_has_is_fetched(pair: Pair, unified: LLMEngine) -> None:
    ids = prompt(150, 102)
    run_unified(pair.p, ids[:50], GREEDY)  # 3 full blocks there; the router thought 8
    settle(pair)
    got = check(pair, unified, ids, 8)
    assert got.remote_tokens == 3 * BS


def test_what_the_puller_holds_is_not_fetched_again(pair: Pair, unified: LLMEngine) -> None:
    ids = prompt(150, 103)
    run_unified(pair.p, ids[:140], GREEDY)
    run_unified(pair.d, ids[:40], GREEDY)  # 2 blocks here already
    settle(pair)
    got = check(pair, unified, ids, 8)
    assert got.remote_tokens == (8 - 2) * BS


def test_an_evicted_prefix_is_recomputed(pair: Pair, unified: LLMEngine) -> None:
    ids = prompt(120, 104)
    run_unified(pair.p, ids, GREEDY)
    settle(pair)
    assert pair.p.reset_prefix_cache()
    misses = pair.p.scheduler.leases.stats["pin_misses"]  # type: ignore[union-attr]
    got = check(pair, unified, ids, 7)
    assert got.remote_tokens == 0
    assert pair.p.scheduler.leases.stats["pin_misses"] == misses + 1  # type: ignore[union-attr]


def test_another_tenants_prefix_cannot_be_named(pair: Pair, unified: LLMEngine) -> None:
    """Tenant a's blocks on the holder; tenant b's request names its own hashes, which the
    holder does not hold: nothing moves, and b's tokens are b's."""
    ids = prompt(120, 105)
    run_unified(pair.p, ids, GREEDY, cache_salt="tenant-a")
    settle(pair)
    got = check(pair, unified, ids, 7, cache_salt="tenant-b")
    assert got.remote_tokens == 0


def test_seeded_sampling_after_a_fetch(pair: Pair, unified: LLMEngine) -> None:
    ids = prompt(110, 106)
    run_unified(pair.p, ids, GREEDY)
    settle(pair)
    ref = run_unified(unified, ids, SEEDED)
    got = fetch(pair, ids, 6, SEEDED)
    assert got.token_ids == ref.token_ids and got.remote_tokens == 6 * BS
    settle(pair)


def test_a_holder_that_does_not_answer_in_time_is_recomputed(
    pair: Pair, unified: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A holder whose engine thread is busy past the pin's wait: the pull is refused, the
    request recomputes, and the late pin is never granted (nothing stays pinned)."""
    ids = prompt(120, 107)
    run_unified(pair.p, ids, GREEDY)
    settle(pair)
    leases = pair.p.scheduler.leases
    assert leases is not None
    monkeypatch.setattr(leases, "wake", None)  # nobody polls the holder meanwhile
    monkeypatch.setattr(sender_module, "PIN_WAIT_S", 0.2)
    got = check(pair, unified, ids, 7)
    assert got.remote_tokens == 0
    leases.poll()  # the holder's thread comes back: the abandoned ask grants nothing
    assert len(leases) == 0


def test_the_operators_link_speed_is_reported_until_pulls_measure_it() -> None:
    """Before its first pull a replica reports the link the operator gave
    (``--kv-link-gbps``), so the router can price a fetch or a split on a fast fabric at
    once (an unknown link is priced at 1 GB/s, which on a GPU never pays)."""
    from kvroute.replica.engine.config import EngineConfig
    from kvroute.replica.kv_transfer.sender import LocalLink

    cfg = EngineConfig(model="tiny", num_blocks=32, kv_transfer=True, kv_link_bytes_per_s=25e9)
    engine = LLMEngine(cfg, kv_link=LocalLink())
    try:
        assert engine.scheduler.load_report().kv_link_bytes_per_s == 25e9
    finally:
        engine.close()
