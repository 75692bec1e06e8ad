"""Prefill on one engine, decode on another: the same tokens as one engine alone.

Why it matters: a disaggregated request's decode replica never computed its prompt; it
pulls the prompt's blocks from the prefill replica (a lease there) and goes on from the
first token the prefill replica sampled. If any block arrived wrong, or the decode side
started from the wrong position, greedy tokens would drift. So every case compares the
split run's tokens and text with an engine that ran the request alone: cold, a prefix
cached on either side, chunked prefill, preemption on the decode side, a LoRA adapter,
tenants' salts, seeded sampling; and a corrupted, refused or lost transfer, which must
fall back to recompute with the same tokens. After each, both pools keep their
invariants, the prefill side holds no lease, and the decode side's KV events replay to
exactly what its cache holds.

Here the two engines share a process and pull through :class:`LocalLink` (no socket); the
transfer plane over ZeroMQ is tested in test_plane.py.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvroute.events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored
from kvroute.events.kv_transfer import MEDIUM_REMOTE, PULL_OK, KVSource
from kvroute.events.replica_api import Resume
from kvroute.replica import SamplingParams
from kvroute.replica.core import kv_loads
from kvroute.replica.engine.config import EngineConfig
from kvroute.replica.engine.llm_engine import LLMEngine
from kvroute.replica.kv_transfer.sender import LocalLink

BS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=77, top_k=20, max_tokens=12, ignore_eos=True)
_ids = itertools.count()


class Replayed:
    """An event sink: the device cache's hash counts as its events tell them."""

    def __init__(self) -> None:
        self.counts: dict[Any, int] = {}

    def __call__(self, events: Sequence[Any]) -> None:
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                self.counts.clear()
            elif isinstance(ev, BlockStored) and ev.medium in (None, MEDIUM_GPU):
                for h in ev.block_hashes:
                    self.counts[h] = self.counts.get(h, 0) + 1
            elif isinstance(ev, BlockRemoved) and ev.medium in (None, MEDIUM_GPU):
                for h in ev.block_hashes:
                    self.counts[h] -= 1
                    if not self.counts[h]:
                        del self.counts[h]


@dataclass
class Pair:
    p: LLMEngine
    d: LLMEngine
    link: LocalLink
    replayed: dict[str, Replayed] = field(default_factory=dict)


def make_engine(name: str, link: LocalLink, **kw: Any) -> tuple[LLMEngine, Replayed]:
    sink = Replayed()
    kw = {"model": "tiny", "num_blocks": 96, **kw}
    cfg = EngineConfig(kv_transfer=True, replica_id=name, **kw)
    engine = LLMEngine(cfg, [sink], kv_link=link)
    assert engine.kv_sender is not None
    link.senders[name] = engine.kv_sender
    return engine, sink


def make_pair(p_kw: dict | None = None, d_kw: dict | None = None) -> Pair:
    link = LocalLink()
    p, p_sink = make_engine("p", link, **(p_kw or {}))
    d, d_sink = make_engine("d", link, **(d_kw or {}))
    return Pair(p, d, link, {"p": p_sink, "d": d_sink})


@pytest.fixture(scope="module")
def pair() -> Pair:
    return make_pair()


@pytest.fixture(scope="module")
def unified() -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny", num_blocks=96))


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


@dataclass
class Result:
    token_ids: list[int]
    text: str
    finish_reason: str | None
    handoff: Any = None
    remote_tokens: int = 0


def drive(engine: LLMEngine, rid: str) -> Result:
    """Steps ``engine`` until ``rid`` ends (other requests in it run alongside)."""
    toks: list[int] = []
    text, finish, handoff, remote = "", None, None, 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for out in engine.step():
            if out.request_id != rid:
                continue
            toks += out.delta_token_ids
            text += out.delta_text
            if out.finished:
                finish = out.outputs[0].finish_reason
                handoff = out.kv_handoff
                remote = out.num_tier_cached_tokens.get(MEDIUM_REMOTE, 0)
                return Result(toks, text, finish, handoff, remote)
    raise AssertionError(f"{rid} did not finish")


def run_unified(engine: LLMEngine, ids: list[int], params: SamplingParams, **kw: Any) -> Result:
    rid = f"u{next(_ids)}"
    engine.add_request(rid, ids, params, **kw)
    return drive(engine, rid)


def run_split(
    pair: Pair,
    ids: list[int],
    params: SamplingParams,
    *,
    d_kw: dict | None = None,
    **kw: Any,
) -> tuple[Result, Result | None]:
    """The prefill on ``pair.p`` (its first token), then the rest on ``pair.d``."""
    rid = f"s{next(_ids)}"
    pair.p.add_request(rid, ids, params, kv_handoff=True, **kw)
    first = drive(pair.p, rid)
    if first.finish_reason != "handoff":
        return first, None
    assert first.handoff is not None and len(first.token_ids) == 1
    resume = Resume(output_token_ids=first.token_ids, sent_chars=len(first.text))
    source = KVSource.of(first.handoff)
    d_kw = kw if d_kw is None else d_kw
    pair.d.add_request(f"{rid}-d", ids, params, resume=resume, kv_source=source, **d_kw)
    rest = drive(pair.d, f"{rid}-d")
    return first, rest


def joined(first: Result, rest: Result | None) -> tuple[list[int], str]:
    if rest is None:
        return first.token_ids, first.text
    return first.token_ids + rest.token_ids, first.text + rest.text


def settle(pair: Pair) -> None:
    """Both engines idle, leases given back, and each one's state checked."""
    for _ in range(50):
        pair.p.step()
        pair.d.step()
        if not len(pair.p.scheduler.leases) and not pair.d.has_unfinished_requests():
            break
        time.sleep(0.01)
    assert len(pair.p.scheduler.leases) == 0, "the prefill side still holds a lease"
    for name, engine in (("p", pair.p), ("d", pair.d)):
        pool = engine.kv_cache_manager.block_pool
        pool.check_invariants()
        assert pool.get_num_free_blocks() == pool.num_blocks, f"{name} holds blocks"
        assert pair.replayed[name].counts == pool.cached_hash_counts(), f"{name} events"


def check_same(pair: Pair, unified: LLMEngine, ids: list[int], params: SamplingParams, **kw):
    ref = run_unified(unified, ids, params, **kw)
    first, rest = run_split(pair, ids, params, **kw)
    assert rest is not None, first.finish_reason
    toks, text = joined(first, rest)
    assert toks == ref.token_ids
    assert text == ref.text
    assert rest.finish_reason == ref.finish_reason
    settle(pair)
    return first, rest


def test_cold_prompt_moves_whole(pair: Pair, unified: LLMEngine) -> None:
    ids = prompt(100, 1)  # 6 full blocks, a 4-token tail
    first, rest = check_same(pair, unified, ids, GREEDY)
    assert first.handoff.num_blocks == 6
    assert rest.remote_tokens == 6 * BS  # every full block pulled, the tail recomputed


def test_prompt_of_whole_blocks(pair: Pair, unified: LLMEngine) -> None:
    """The last prompt token ends a block: D still computes the first token's KV."""
    check_same(pair, unified, prompt(64, 2), GREEDY)


def test_prefix_cached_on_prefill_side(pair: Pair, unified: LLMEngine) -> None:
    ids = prompt(120, 3)
    run_unified(pair.p, ids[:70], GREEDY)  # 4 blocks cached on P
    _, rest = check_same(pair, unified, ids, GREEDY)
    assert rest.remote_tokens == 7 * BS


def test_prefix_cached_on_decode_side_pulls_only_the_rest(pair: Pair, unified: LLMEngine) -> None:
    ids = prompt(120, 4)
    run_unified(pair.d, ids[:50], GREEDY)  # 3 blocks cached on D
    settle(pair)
    _, rest = check_same(pair, unified, ids, GREEDY)
    assert rest.remote_tokens == (7 - 3) * BS


def test_seeded_sampling(pair: Pair, unified: LLMEngine) -> None:
    check_same(pair, unified, prompt(90, 5), SEEDED)


def test_salted_tenants(pair: Pair, unified: LLMEngine) -> None:
    ids = prompt(80, 6)
    _, rest = check_same(pair, unified, ids, GREEDY, cache_salt="tenant-a")
    assert rest.remote_tokens == 5 * BS


def test_another_tenants_request_cannot_pull_the_lease(pair: Pair, unified: LLMEngine) -> None:
    """The same prompt under another salt hashes to other blocks: the source refuses them
    (mismatch), and the request recomputes with the same tokens."""
    ids = prompt(80, 7)
    ref = run_unified(unified, ids, GREEDY, cache_salt="tenant-b")
    failures = pair.d.kv_tiers.remote.stats["failures"]
    first, rest = run_split(
        pair, ids, GREEDY, cache_salt="tenant-a", d_kw={"cache_salt": "tenant-b"}
    )
    assert joined(first, rest)[0] == ref.token_ids
    assert rest.remote_tokens == 0
    assert pair.d.kv_tiers.remote.stats["failures"] == failures + 1
    settle(pair)


def test_first_token_that_ends_the_request_leases_nothing(pair: Pair) -> None:
    first, rest = run_split(pair, prompt(60, 8), SamplingParams(temperature=0.0, max_tokens=1))
    assert rest is None and first.finish_reason == "length" and first.handoff is None
    assert len(pair.p.scheduler.leases) == 0


def test_short_prompt_has_nothing_to_move(pair: Pair, unified: LLMEngine) -> None:
    first, rest = check_same(pair, unified, prompt(10, 9), GREEDY)
    assert first.handoff.num_blocks == 0 and rest.remote_tokens == 0


def test_stop_string_held_back_across_the_handoff(pair: Pair, unified: LLMEngine) -> None:
    """The prefill side holds back text that may start a stop string: the decode side
    goes on with it (Resume.sent_chars), as one engine would."""
    ids = prompt(70, 10)
    probe = run_unified(unified, ids, GREEDY)
    stop = probe.text[1:4] if len(probe.text) > 4 else probe.text
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop])
    check_same(pair, unified, ids, params)


class _Tamper:
    """A link that hands the puller a wrong byte in one block, or nothing at all."""

    def __init__(self, inner: LocalLink, bad_block: int | None) -> None:
        self.inner = inner
        self.bad_block = bad_block

    def pull(self, source, start, hashes, sink, deadline_s):  # type: ignore[no-untyped-def]
        if self.bad_block is None:
            return 0, "unreachable"

        def bad_sink(i: int, data: memoryview, digest: int) -> bool:
            if i == self.bad_block:
                flipped = bytearray(data)
                flipped[len(flipped) // 2] ^= 0xFF
                return sink(i, memoryview(flipped), digest)
            return sink(i, data, digest)

        return self.inner.pull(source, start, hashes, bad_sink, deadline_s)

    def keep(self, source, extend_s):  # type: ignore[no-untyped-def]
        self.inner.keep(source, extend_s)

    def done(self, source):  # type: ignore[no-untyped-def]
        self.inner.done(source)


@pytest.mark.parametrize("bad_block", [2, None], ids=["corrupted", "lost"])
def test_failed_transfer_recomputes_the_same_tokens(
    pair: Pair, unified: LLMEngine, bad_block: int | None
) -> None:
    remote = pair.d.kv_tiers.remote
    inner = remote.link
    remote.link = _Tamper(inner, bad_block)
    try:
        _, rest = check_same(pair, unified, prompt(100, 11), GREEDY)
    finally:
        remote.link = inner
    # corrupted: the blocks before the bad one were used; lost: none
    assert rest.remote_tokens == (2 * BS if bad_block == 2 else 0)


def test_expired_lease_recomputes(unified: LLMEngine) -> None:
    pair = make_pair(p_kw={"kv_lease_s": 0.05})
    ids = prompt(100, 12)
    ref = run_unified(unified, ids, GREEDY)
    rid = "exp"
    pair.p.add_request(rid, ids, GREEDY, kv_handoff=True)
    first = drive(pair.p, rid)
    time.sleep(0.1)
    pair.p.step()  # the lease expires here
    assert len(pair.p.scheduler.leases) == 0
    assert pair.p.scheduler.leases.stats["expired"] == 1
    resume = Resume(output_token_ids=first.token_ids, sent_chars=len(first.text))
    pair.d.add_request("exp-d", ids, GREEDY, resume=resume, kv_source=KVSource.of(first.handoff))
    rest = drive(pair.d, "exp-d")
    assert joined(first, rest)[0] == ref.token_ids
    assert rest.remote_tokens == 0
    settle(pair)


def test_abort_before_the_pull_frees_the_lease(pair: Pair) -> None:
    ids = prompt(100, 13)
    pair.p.add_request("ab", ids, GREEDY, kv_handoff=True)
    first = drive(pair.p, "ab")
    assert len(pair.p.scheduler.leases) == 1
    resume = Resume(output_token_ids=first.token_ids, sent_chars=len(first.text))
    pair.d.add_request("ab-d", ids, GREEDY, resume=resume, kv_source=KVSource.of(first.handoff))
    pair.d.abort_requests(["ab-d"])
    settle(pair)  # asserts the lease is gone


def test_lease_revoked_when_the_source_needs_its_blocks(unified: LLMEngine) -> None:
    """A source short of blocks revokes the oldest lease rather than stall: the puller
    recomputes, with the same tokens."""
    pair = make_pair(p_kw={"num_blocks": 16})  # 256 tokens
    ids = prompt(150, 14)  # 9 blocks leased
    ref = run_unified(unified, ids, GREEDY)
    pair.p.add_request("rv", ids, GREEDY, kv_handoff=True)
    first = drive(pair.p, "rv")
    run_unified(pair.p, prompt(200, 15), GREEDY)  # needs 13 blocks: only 7 are free
    assert pair.p.scheduler.leases.stats["revoked"] == 1
    resume = Resume(output_token_ids=first.token_ids, sent_chars=len(first.text))
    pair.d.add_request("rv-d", ids, GREEDY, resume=resume, kv_source=KVSource.of(first.handoff))
    rest = drive(pair.d, "rv-d")
    assert joined(first, rest)[0] == ref.token_ids
    assert rest.remote_tokens == 0
    settle(pair)


def test_chunked_prefill_both_sides(unified: LLMEngine) -> None:
    kw = {"max_num_batched_tokens": 32, "long_prefill_token_threshold": 32}
    pair = make_pair(p_kw=dict(kw), d_kw=dict(kw))
    for seed in (16, 17):
        check_same(pair, unified, prompt(140, seed), GREEDY)


def test_preempted_on_the_decode_side(unified: LLMEngine) -> None:
    """Three split requests decode together on a decode side too small for them: some are
    preempted (recomputed from their own pulled copy), and each ends as alone."""
    pair = make_pair(d_kw={"num_blocks": 20})  # 320 tokens for 3 x (90 + 40)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [prompt(90, 20 + i) for i in range(3)]
    refs = [run_unified(unified, ids, params).token_ids for ids in prompts]
    firsts = []
    for i, ids in enumerate(prompts):
        pair.p.add_request(f"pe{i}", ids, params, kv_handoff=True)
        firsts.append(drive(pair.p, f"pe{i}"))
    for i, (ids, first) in enumerate(zip(prompts, firsts, strict=True)):
        resume = Resume(output_token_ids=first.token_ids, sent_chars=len(first.text))
        source = KVSource.of(first.handoff)
        pair.d.add_request(f"pe{i}-d", ids, params, resume=resume, kv_source=source)
    got: dict[str, list[int]] = {f"pe{i}-d": [] for i in range(3)}
    deadline = time.monotonic() + 120
    while pair.d.has_unfinished_requests() and time.monotonic() < deadline:
        for out in pair.d.step():
            got[out.request_id] += out.delta_token_ids
    assert pair.d.scheduler.num_preemptions > 0
    for i, first in enumerate(firsts):
        assert first.token_ids + got[f"pe{i}-d"] == refs[i]
    settle(pair)


def test_under_a_lora_adapter(tmp_path_factory: pytest.TempPathFactory) -> None:
    from tests.lora_adapters import SHAPES, make_adapter

    path = make_adapter(tmp_path_factory.mktemp("lora") / "a", 5, **SHAPES[1])
    kw = {"lora_modules": {"a": path}}
    pair = make_pair(p_kw=dict(kw), d_kw=dict(kw))
    ref_engine = LLMEngine(EngineConfig(model="tiny", num_blocks=96, **kw))
    ids = prompt(100, 30)
    base = run_unified(ref_engine, ids, GREEDY)
    first, rest = check_same(pair, ref_engine, ids, GREEDY, lora_name="a")
    assert rest.remote_tokens == 6 * BS
    assert joined(first, rest)[0] != base.token_ids  # the adapter changed something
    # A request for the base model cannot pull the adapter's blocks (their hashes differ).
    failures = pair.d.kv_tiers.remote.stats["failures"]
    first, rest = run_split(pair, ids, GREEDY, lora_name="a", d_kw={})
    assert rest.remote_tokens == 0
    assert pair.d.kv_tiers.remote.stats["failures"] == failures + 1
    settle(pair)


def test_pull_of_a_released_lease_is_refused(pair: Pair) -> None:
    ids = prompt(60, 31)
    pair.p.add_request("rl", ids, GREEDY, kv_handoff=True)
    first = drive(pair.p, "rl")
    sender = pair.p.kv_sender
    lease = first.handoff.lease
    hashes = list(pair.p.scheduler.leases._leases[lease].hashes)
    got: list[int] = []
    assert sender.serve(lease, 0, hashes, lambda i, d, h: got.append(i) or True) == (3, PULL_OK)
    sender.done(lease)
    pair.p.step()
    assert sender.serve(lease, 0, hashes, lambda i, d, h: True) == (0, "unknown")
    settle(pair)


@pytest.mark.slow
def test_smollm2_split_equals_one_engine() -> None:
    """A real pretrained model: cold, and with the prefix cached on the decode side."""
    link = LocalLink()
    kw = {"model": "smollm2-135m", "num_blocks": 64}
    p, p_sink = make_engine("p", link, **kw)
    d, d_sink = make_engine("d", link, **kw)
    pair = Pair(p, d, link, {"p": p_sink, "d": d_sink})
    ref_engine = LLMEngine(EngineConfig(**kw))
    text = "Disaggregated serving computes the prompt on one replica and decodes elsewhere. " * 3
    ids = ref_engine.tokenize(text)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    _, rest = check_same(pair, ref_engine, ids, params)
    assert rest.remote_tokens == (len(ids) // BS) * BS
    other = ref_engine.tokenize("A different opening. " + text)
    # two blocks cached on the decode side (one output token: a greedy continuation of
    # this repetitive text could fill a third block with the prompt's own next tokens)
    run_unified(d, other[:32], SamplingParams(temperature=0.0, max_tokens=1))
    settle(pair)
    _, rest = check_same(pair, ref_engine, other, params)
    assert rest.remote_tokens == (len(other) // BS - 2) * BS


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "not-kept"])
def test_a_lease_is_kept_while_its_request_queues_on_the_decode_side(
    unified: LLMEngine, monkeypatch: pytest.MonkeyPatch, keep: bool
) -> None:
    """The decode side is busy (one sequence at a time) for longer than the source's lease:
    kept alive by Keep messages, the lease is still there when the request's turn comes,
    and its prompt is pulled, not recomputed. Without them it lapses (the same tokens,
    computed)."""
    monkeypatch.setattr(kv_loads, "KEEP_EVERY_S", 0.1 if keep else 1e9)
    pair = make_pair(p_kw={"kv_lease_s": 0.5}, d_kw={"max_num_seqs": 1})
    ids = prompt(100, 21)
    ref = run_unified(unified, ids, GREEDY)
    pair.d.add_request("busy", prompt(40, 22), SamplingParams(max_tokens=400, ignore_eos=True))
    pair.d.step()  # it runs; the next request waits behind it
    pair.p.add_request("kept", ids, GREEDY, kv_handoff=True)
    first = drive(pair.p, "kept")
    resume = Resume(output_token_ids=first.token_ids, sent_chars=len(first.text))
    pair.d.add_request("kept-d", ids, GREEDY, resume=resume, kv_source=KVSource.of(first.handoff))
    until = time.monotonic() + 1.2  # past the lease, twice over
    while time.monotonic() < until:
        pair.d.step()
        pair.p.step()  # the source's poll: expiry is checked here
        time.sleep(0.01)
    assert pair.d.scheduler.requests["kept-d"].status.name == "WAITING"
    pair.d.abort_requests(["busy"])
    rest = drive(pair.d, "kept-d")
    assert joined(first, rest)[0] == ref.token_ids
    expired = pair.p.scheduler.leases.stats["expired"]
    if keep:
        assert rest.remote_tokens > 0 and expired == 0
        assert pair.d.scheduler.kv_loads.num_keeps >= 5
    else:
        assert rest.remote_tokens == 0 and expired == 1
    settle(pair)
