"""What the PrefixIndex tests share: events built and fed by hand, fake replicas driven by
Churn (tests/events/transport/streams.py) with the chains they stored, and the brute-force
truth the index is checked against."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

from kvroute.events import BlockRemoved, BlockStored, EventBatch, KVCacheEvent, to_external
from kvroute.router.routing.index import PrefixIndex

from ...events.transport.streams import BS, Churn


def stored(hashes: list, parent=None) -> BlockStored:
    return BlockStored(list(hashes), parent, [1] * (BS * len(hashes)), BS, None, "GPU", None)


def feed(index: PrefixIndex, rid: str, *events: KVCacheEvent) -> None:
    index.apply(rid, EventBatch(0.0, list(events)))


def convert(events: list[KVCacheEvent], form: str) -> list[KVCacheEvent]:
    """The same events with hashes in vLLM's uint64 form (``form="int"``)."""
    if form == "bytes":
        return events
    x = lambda h: None if h is None else to_external(h, "int")  # noqa: E731
    out: list[KVCacheEvent] = []
    for ev in events:
        if isinstance(ev, BlockStored):
            out.append(stored([x(h) for h in ev.block_hashes], x(ev.parent_block_hash)))
        elif isinstance(ev, BlockRemoved):
            out.append(BlockRemoved([x(h) for h in ev.block_hashes], ev.medium))
        else:
            out.append(ev)
    return out


def brute_match(truths: dict[str, Counter], chain: Sequence) -> dict[str, int]:
    """Reference: per replica, leading blocks of ``chain`` it holds (zeros left out)."""
    out = {}
    for rid, truth in truths.items():
        n = 0
        while n < len(chain) and truth[chain[n]] > 0:
            n += 1
        if n:
            out[rid] = n
    return out


class Fleet:
    """Several fake replicas driven by Churn, with the chains their stores built."""

    def __init__(self, n: int, seed: int, form: str = "bytes", clear_every: int = 0) -> None:
        # Replicas clear at different steps (clear_every + 7 i), as engines would.
        self.churns = {
            f"r{i}": Churn(seed + i, clear_every and clear_every + 7 * i) for i in range(n)
        }
        for i, c in enumerate(self.churns.values()):
            c.next_id = 40 * i  # hash ranges overlap partly: shared and private hashes
        self.form = form
        self.parents: dict[str, dict] = {rid: {} for rid in self.churns}

    def step(
        self, index: PrefixIndex | None = None, only: str | None = None
    ) -> dict[str, list[KVCacheEvent]]:
        out = {}
        for rid in [only] if only else self.churns:
            events = convert(self.churns[rid].step(), self.form)
            for ev in events:
                if isinstance(ev, BlockStored):
                    parent = ev.parent_block_hash
                    for h in ev.block_hashes:
                        self.parents[rid].setdefault(h, parent)  # first store is the real one
                        parent = h
            if index is not None:
                index.apply(rid, EventBatch(0.0, events))
            out[rid] = events
        return out

    def truths(self) -> dict[str, Counter]:
        x = (lambda h: h) if self.form == "bytes" else (lambda h: to_external(h, "int"))
        return {
            rid: Counter({x(h): c for h, c in churn.truth.items()})
            for rid, churn in self.churns.items()
        }

    def chains(self, rng: random.Random, k: int = 200) -> list[list]:
        """Root-to-block chains as the replicas stored them, some cut or with a foreign hash
        spliced in (a replica holding block i but not i-1 must get no credit past i-1)."""
        out = []
        for _ in range(k):
            rid = rng.choice(list(self.parents))
            h = rng.choice(list(self.parents[rid]))
            chain = [h]
            while (p := self.parents[rid].get(chain[-1])) is not None and len(chain) < 1000:
                chain.append(p)
            chain.reverse()
            r = rng.random()
            if r < 0.2 and len(chain) > 1:
                chain.insert(rng.randrange(1, len(chain)), rng.choice(list(self.parents[rid])))
            elif r < 0.3:
                chain.append(b"\xff" * 16 if self.form == "bytes" else 2**64 - 1)
            out.append(chain)
        return out


def assert_matches_truth(index: PrefixIndex, fleet: Fleet, rng: random.Random) -> list[dict]:
    truths = fleet.truths()
    for rid, truth in truths.items():
        assert index.counts(rid) == dict(truth), rid
        assert index.num_blocks(rid) == len(truth)
    assert len(index) == len(set().union(*truths.values()))
    index.check_invariants()
    matches = []
    for chain in fleet.chains(rng):
        matches.append(index.match(chain))
        assert matches[-1] == brute_match(truths, chain), chain
    return matches
