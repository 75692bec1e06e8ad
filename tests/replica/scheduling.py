"""A scheduler under test: a fake model over a fake paged KV cache, and a harness that
checks every step's invariants (see test_scheduler.py for why the fake is faithful)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvroute.events import BlockHasher, BlockSet
from kvroute.events.replica_api import SamplingParams
from kvroute.replica.core.kv_cache_manager import KVCacheManager
from kvroute.replica.core.request import Request, RequestStatus
from kvroute.replica.core.scheduler import (
    ScheduledRequest,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)

B = 4  # block size
VOCAB = 32
MOD = (1 << 61) - 1


def roll(h: int, tok: int) -> int:
    return (h * 1_000_003 + tok + 1) % MOD


def to_token(h: int) -> int:
    return ((h * 0x9E3779B97F4A7C15) >> 20) % VOCAB


def reference(prompt: list[int], sp: SamplingParams, eos: int | None, max_len: int) -> list[int]:
    """What the fake model generates with no scheduler at all."""
    toks, h, out = list(prompt), 0, []
    for t in toks:
        h = roll(h, t)
    while True:
        t = to_token(h)
        toks.append(t)
        out.append(t)
        h = roll(h, t)
        if len(out) >= sp.min_tokens and (
            (t == eos and not sp.ignore_eos) or t in sp.stop_token_ids
        ):
            return out
        if len(out) >= sp.max_tokens or len(toks) >= max_len:
            return out


class FakeRunner:
    """One batched forward pass: every scheduled token's KV is written, then read back."""

    def __init__(self) -> None:
        self.kv: dict[int, int] = {}  # slot -> rolling hash of the tokens up to it
        self.prefix: dict[str, list[int]] = {}

    def _hashes(self, req: Request) -> list[int]:
        hs = self.prefix.setdefault(req.request_id, [])
        for t in req.all_token_ids[len(hs) :]:
            hs.append(roll(hs[-1] if hs else 0, t))
        return hs

    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        for sr in out.scheduled:
            hs = self._hashes(sr.request)
            end = sr.num_computed_tokens + sr.num_new_tokens
            assert end <= sr.request.num_tokens
            assert len(sr.block_ids) == -(-end // B)
            for p in range(sr.num_computed_tokens, end):
                self.kv[sr.block_ids[p // B] * B + p % B] = hs[p]
        sampled = {}
        for sr in out.scheduled:
            hs = self._hashes(sr.request)
            end = sr.num_computed_tokens + sr.num_new_tokens
            read = [self.kv.get(sr.block_ids[p // B] * B + p % B) for p in range(end)]
            assert read == hs[:end], f"{sr.request.request_id}: stale or foreign KV"
            if sr.samples:
                sampled[sr.request.request_id] = to_token(read[-1])
        return sampled


class Harness:
    """Drives a scheduler step by step and checks every step's invariants."""

    def __init__(
        self,
        num_blocks: int,
        runner: Callable[[SchedulerOutput], dict[str, int]] | None = None,
        **cfg: Any,
    ) -> None:
        self.config = SchedulerConfig(**cfg)
        self.kv = KVCacheManager(num_blocks, BlockHasher(block_size=B))
        self.sched = Scheduler(self.config, self.kv)
        self.pool = self.kv.block_pool
        self.run = runner or FakeRunner().execute
        self.replay = BlockSet()
        self.history: list[SchedulerOutput] = []
        self.done: dict[str, Request] = {}

    def add(
        self,
        rid: str,
        prompt: list[int],
        eos: int | None = None,
        tenant: str | None = None,
        **sp: Any,
    ) -> Request:
        req = Request(rid, prompt, SamplingParams(**sp), eos, arrival_time=0.0, tenant=tenant)
        self.sched.add_request(req)
        return req

    def step(self) -> SchedulerOutput:
        s, kv = self.sched, self.kv
        before = {rid: (r.status, r.num_computed_tokens) for rid, r in s.requests.items()}
        out = s.schedule()
        self.history.append(out)
        # the budget, and each chunk continuing exactly where the request stood
        assert out.num_scheduled_tokens == sum(x.num_new_tokens for x in out.scheduled)
        assert out.num_scheduled_tokens <= self.config.max_num_batched_tokens
        assert len({x.request.request_id for x in out.scheduled}) == len(out.scheduled)
        admitted = False
        for x in out.scheduled:
            r = x.request
            status, computed = before[r.request_id]
            assert x.num_new_tokens > 0 and r.status == RequestStatus.RUNNING
            assert r.num_computed_tokens == x.num_computed_tokens + x.num_new_tokens
            assert x.samples == (r.num_computed_tokens == r.num_tokens)
            if status == RequestStatus.RUNNING:
                assert not admitted, "running requests come before admitted ones"
                assert x.num_computed_tokens == computed
            else:  # admitted: starts at its block-aligned prefix hit
                admitted = True
                assert computed == 0
                assert x.num_computed_tokens % B == 0
                assert x.num_computed_tokens <= r.num_tokens - 1
            if not self.config.enable_chunked_prefill:
                assert x.samples
        for rid in out.preempted_request_ids:
            assert before[rid][0] == RequestStatus.RUNNING
            assert s.requests[rid].status == RequestStatus.PREEMPTED
        assert not set(out.preempted_request_ids) & {x.request.request_id for x in out.scheduled}
        if out.preempted_request_ids:  # victims lead their tenant's queue; nothing admitted
            victims = [s.requests[rid] for rid in out.preempted_request_ids[::-1]]
            assert s.waiting.peek() is victims[0]  # the last preempted is served first
            for tenant in {v.tenant for v in victims}:
                mine = [v for v in victims if v.tenant == tenant]
                queued = [r for r in s.waiting if r.tenant == tenant]
                assert queued[: len(mine)] == mine
            assert not admitted
        assert len(s.running) <= self.config.max_num_seqs
        for r in s.waiting:  # never holds blocks while waiting
            assert r.num_computed_tokens == 0 and not kv.get_block_ids(r.request_id)
        for r in s.running:
            assert len(kv.get_block_ids(r.request_id)) == -(-r.num_computed_tokens // B)
        updated = s.update_from_output(out, self.run(out))
        for r in updated:
            if r.is_finished:
                self.done[r.request_id] = r
        self.pool.check_invariants()
        for ev in kv.take_events():
            self.replay.apply(ev)
        assert self.replay.counts() == self.pool.cached_hash_counts()
        return out

    def run_all(self, max_steps: int = 10_000) -> int:
        n = 0
        while self.sched.has_unfinished_requests():
            self.step()
            n += 1
            assert n < max_steps, "the scheduler does not make progress"
        self.assert_drained()
        return n

    def assert_drained(self) -> None:
        assert self.pool.get_num_free_blocks() == self.pool.num_blocks
        assert not self.kv.req_to_blocks and not self.kv.req_to_block_hashes
        assert not self.sched.requests and not self.sched.running and not self.sched.waiting


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 1000 for i in range(n)]


def scheduled_ids(out: SchedulerOutput) -> dict[str, ScheduledRequest]:
    return {x.request.request_id: x for x in out.scheduled}
