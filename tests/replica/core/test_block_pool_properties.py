"""Block pool and KV cache manager under random op sequences: invariants hold and the events
replay exactly."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvroute.events import BlockSet, to_external
from kvroute.replica.core.block_pool import KVCacheBlock

from .pool_helpers import B, Req, hashes, make

# -- the property tests -----------------------------------------------------------------
SYSTEM_PROMPTS = [[], [1, 2, 3, 1, 2], [7, 7, 7, 7, 1, 2, 3, 4, 5]]


class PoolModel:
    """A manager under random ops, with what the test knows independently of it: the live
    requests and, per physical block, the prefix (salt and LoRA included) last written there.

    Ops: admit (lookup + allocate a chunk), step (next prefill chunk, or append a decode
    token and schedule it; dropped when out of blocks), finish, preempt-and-resume, reset.
    A small pool makes allocation evict constantly."""

    def __init__(self, num_blocks: int, hash_form: str) -> None:
        self.mgr = make(num_blocks, hash_form=hash_form)
        self.form = hash_form
        self.queue = list(range(num_blocks))  # the expected free queue, head first
        self.queries = self.hits = 0
        self.live: dict[str, Req] = {}
        self.content: dict[int, tuple] = {}
        self.history: list[tuple[list[int], str | None, str | None]] = []
        self.replay = BlockSet()  # fed every event ever emitted, from empty
        self.n = 0
        self.seen: Counter[str] = Counter()  # what happened, for coverage checks

    def _write(self, req: Req, start: int, end: int) -> None:
        """The forward pass: tokens [start, end) of req land in its blocks."""
        table = self.mgr.req_to_blocks[req.request_id]
        key = (req.cache_salt, req.lora_name)
        for j in range(start // B, -(-end // B)):
            prefix = tuple(req.all_token_ids[: min(end, (j + 1) * B)])
            self.content[table[j].block_id] = (key, prefix)

    def _allocated(self, hit: list[KVCacheBlock], new: list[KVCacheBlock]) -> None:
        """LRU by the book: hits leave the queue, new blocks come off its head."""
        for b in hit:
            if b.block_id in self.queue:
                self.queue.remove(b.block_id)
        assert [b.block_id for b in new] == self.queue[: len(new)]
        del self.queue[: len(new)]

    def _free(self, req: Req) -> None:
        """Reverse order: the request's blocks that nobody else holds join the tail."""
        table = self.mgr.req_to_blocks.get(req.request_id, [])
        others = Counter(
            b.block_id for r, t in self.mgr.req_to_blocks.items() if r != req.request_id for b in t
        )
        self.queue += [b.block_id for b in reversed(table) if not others[b.block_id]]
        self.mgr.free(req)

    def _pick(self, i: int) -> Req | None:
        return self.live[sorted(self.live)[i % len(self.live)]] if self.live else None

    def admit(self, tokens: list[int], salt: str | None, lora: str | None, chunk: int) -> None:
        self.n += 1
        self.history.append((tokens, salt, lora))
        self._admit(Req(f"r{self.n}", list(tokens), 0, salt, lora), chunk)

    def admit_again(self, i: int, chunk: int) -> None:
        if self.history:
            self.admit(*self.history[i % len(self.history)], chunk)

    def _admit(self, req: Req, chunk: int) -> None:
        blocks, n = self.mgr.get_computed_blocks(req)
        key = (req.cache_salt, req.lora_name)
        for i, blk in enumerate(blocks):  # a hit must hold exactly this request's prefix
            assert self.content[blk.block_id] == (key, tuple(req.all_token_ids[: (i + 1) * B]))
        assert n < len(req.all_token_ids)
        self.queries += len(req.all_token_ids)
        self.hits += n
        k = min(chunk, len(req.all_token_ids) - n)
        self.seen["hit" if n else "miss"] += 1
        new = self.mgr.allocate_slots(req, k, n, blocks)
        if new is None:
            self.seen["out of blocks"] += 1
            self.mgr.free(req)
            return
        self._allocated(blocks, new)
        self._write(req, n, n + k)
        req.num_computed_tokens = n + k
        self.live[req.request_id] = req

    def step(self, i: int, chunk: int, tok: int) -> None:
        req = self._pick(i)
        if req is None:
            return
        if req.num_computed_tokens == len(req.all_token_ids):
            req.all_token_ids.append(tok)  # decode: the sampled token joins the request
            chunk = 1
        start = req.num_computed_tokens
        k = min(chunk, len(req.all_token_ids) - start)
        new = self.mgr.allocate_slots(req, k)
        if new is None:
            self._free(self.live.pop(req.request_id))
            return
        self._allocated([], new)
        self._write(req, start, start + k)
        req.num_computed_tokens += k

    def finish(self, i: int) -> None:
        req = self._pick(i)
        if req is not None:
            self._free(self.live.pop(req.request_id))

    def preempt_and_resume(self, i: int, chunk: int) -> None:
        req = self._pick(i)
        if req is None:
            return
        self._free(self.live.pop(req.request_id))
        req.num_computed_tokens = 0
        self._admit(req, chunk)

    def reset(self) -> None:
        ok = self.mgr.reset_prefix_cache()
        self.seen[f"reset {ok}"] += 1
        assert ok == (not self.live)

    def check(self) -> None:
        mgr, pool = self.mgr, self.mgr.block_pool
        pool.check_invariants()
        for ev in mgr.take_events():
            self.seen[type(ev).__name__] += 1
            self.replay.apply(ev)
        counts = pool.cached_hash_counts()
        assert self.replay.counts() == counts
        assert self.replay.unknown_removals == 0
        if any(c > 1 for c in counts.values()):
            self.seen["duplicate copies"] += 1
        # Each cached block: its hash names what it holds, and the stream told its parent
        # and tokens right (the content model knows them independently of the pool).
        records = self.replay.records()
        for b in pool.blocks:
            if b.block_hash is None:
                continue
            (salt, lora), prefix = self.content[b.block_id]
            assert len(prefix) % B == 0
            chain = hashes(list(prefix), salt, lora)
            assert b.block_hash == chain[-1]
            # Prefix-closed: holders hold their whole prefix and reverse-order free puts a
            # parent behind its child, so no parent is evicted before its last child.
            assert len(chain) == 1 or pool.get_cached_block(chain[-2]) is not None
            rec = records[to_external(b.block_hash, self.form)]  # type: ignore[arg-type]
            parent = to_external(chain[-2], self.form) if len(chain) > 1 else None  # type: ignore[arg-type]
            assert rec.parent == parent
            assert rec.token_ids == list(prefix[-B:])
            assert rec.stored_by.lora_name == lora
        assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == self.queue
        assert (mgr.prefix_cache_queries, mgr.prefix_cache_hits) == (self.queries, self.hits)
        assert set(mgr.req_to_blocks) == set(self.live)
        holders: Counter[int] = Counter()
        for rid, req in self.live.items():
            table = mgr.req_to_blocks[rid]
            ids = [b.block_id for b in table]
            assert len(set(ids)) == len(ids)
            holders.update(ids)
            assert len(table) == -(-req.num_computed_tokens // B)
            n_cached = mgr.num_cached_block.get(rid, 0)
            assert n_cached == req.num_computed_tokens // B
            assert [b.block_hash for b in table[:n_cached]] == mgr.block_hashes(req)[:n_cached]
        for b in pool.blocks:
            assert b.ref_cnt == holders[b.block_id]
        assert mgr.usage == pytest.approx(len(holders) / pool.num_blocks)


_tail = st.lists(st.integers(0, 2), max_size=10)
_salt = st.sampled_from([None, "s1"])
_lora = st.sampled_from([None, "L"])


class PoolMachine(RuleBasedStateMachine):
    """Hypothesis drives :class:`PoolModel`; it shrinks a failure to a short op sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.m: PoolModel | None = None

    @initialize(num_blocks=st.integers(1, 12), form=st.sampled_from(["bytes", "int"]))
    def setup(self, num_blocks: int, form: str) -> None:
        self.m = PoolModel(num_blocks, form)

    @rule(system=st.integers(0, 2), tail=_tail, salt=_salt, lora=_lora, chunk=st.integers(1, 16))
    def admit(self, system: int, tail: list[int], salt, lora, chunk: int) -> None:
        self.m.admit(SYSTEM_PROMPTS[system] + tail or [0], salt, lora, chunk)

    @rule(i=st.integers(0, 63), chunk=st.integers(1, 16))
    def admit_again(self, i: int, chunk: int) -> None:
        self.m.admit_again(i, chunk)

    @rule(i=st.integers(0, 63), chunk=st.integers(1, 8), tok=st.integers(0, 2))
    def step(self, i: int, chunk: int, tok: int) -> None:
        self.m.step(i, chunk, tok)

    @rule(i=st.integers(0, 63))
    def finish(self, i: int) -> None:
        self.m.finish(i)

    @rule(i=st.integers(0, 63), chunk=st.integers(1, 16))
    def preempt_and_resume(self, i: int, chunk: int) -> None:
        self.m.preempt_and_resume(i, chunk)

    @rule()
    def reset(self) -> None:
        self.m.reset()

    @invariant()
    def consistent(self) -> None:
        if self.m is not None:
            self.m.check()
            for what, n in self.m.seen.items():
                if n:
                    event(what)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_random_op_sequences_keep_invariants_and_replay_exactly() -> None:
    """Long weighted sequences (rare resets), where hypothesis' runs are short and uniform;
    and a check that the interesting cases really happened."""
    import random

    total: Counter[str] = Counter()
    for seed in range(40):
        rng = random.Random(seed)
        m = PoolModel(rng.randint(2, 16), rng.choice(["bytes", "int"]))
        for _ in range(300):
            r = rng.random()
            i, chunk = rng.randrange(64), rng.randint(1, 12)
            if r < 0.30:
                tail = [rng.randint(0, 2) for _ in range(rng.randint(0, 10))]
                prompt = rng.choice(SYSTEM_PROMPTS) + tail or [0]
                m.admit(prompt, rng.choice([None, "s1"]), rng.choice([None, "L"]), chunk)
            elif r < 0.45:
                m.admit_again(i, chunk)
            elif r < 0.80:
                m.step(i, chunk, rng.randint(0, 2))
            elif r < 0.92:
                m.finish(i)
            elif r < 0.97:
                m.preempt_and_resume(i, chunk)
            else:
                m.reset()
            m.check()
        total += m.seen
    for what in ("hit", "out of blocks", "BlockRemoved", "duplicate copies", "reset True"):
        assert total[what] > 10, (what, total)
