"""PrefixIndex's predictions: the blocks a routed request will store, counted until they
expire or real events arrive, and sampled predictions credited only as far as the samples
prove."""

from __future__ import annotations

import random

from kvroute.events import AllBlocksCleared, BlockRemoved
from kvroute.router.routing.index import PrefixIndex

from .index_truth import feed, stored


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_predictions_count_expire_and_yield_to_real_events() -> None:
    clock = FakeClock()
    index = PrefixIndex(clock=clock)
    a, b, c, d = (bytes([i]) * 16 for i in range(1, 5))
    feed(index, "r0", stored([a]))
    assert index.predict("r0", [a, b, c], ttl_s=2.0) == 2  # a is really held already
    assert index.match([a, b, c, d]) == {"r0": 3}
    assert index.counts("r0") == {a: 1} and index.num_predicted("r0") == 2
    index.check_invariants()
    clock.t += 1.9
    assert index.match([a, b, c]) == {"r0": 3}
    clock.t += 0.1
    assert index.match([a, b, c]) == {"r0": 1}
    assert index.num_predicted("r0") == 0 and len(index) == 1
    index.check_invariants()

    # Real events replace predictions: the stored blocks outlive the ttl.
    index.predict("r1", [a, b, c], ttl_s=2.0)
    feed(index, "r1", stored([a, b]))
    clock.t += 5
    assert index.match([a, b, c]) == {"r0": 1, "r1": 2}
    assert index.counts("r1") == {a: 1, b: 1}
    # A remove of a predicted block, and a reset, clear predictions.
    index.predict("r1", [a, b, c, d], ttl_s=2.0)
    assert index.match([a, b, c, d]) == {"r0": 1, "r1": 4}
    feed(index, "r1", BlockRemoved([c], "GPU"))
    assert index.match([a, b, c, d]) == {"r0": 1, "r1": 2}
    feed(index, "r1", AllBlocksCleared())
    assert index.match([a, b, c, d]) == {"r0": 1}
    assert index.num_predicted("r1") == 0
    index.check_invariants()
    # An explicit ``now`` wins over the clock.
    index.predict("r2", [a, b], ttl_s=1.0, now=0.0)
    assert index.match([a, b], now=0.5) == {"r0": 1, "r2": 2}
    assert index.match([a, b], now=1.0) == {"r0": 1}


def test_sampled_predictions_credit_what_the_samples_prove() -> None:
    """prediction_stride 8: a routed request's samples (positions 7, 15, ... and its last
    block) stand for its whole prefix; a sibling is credited up to the last sample it
    shares, never beyond what the routed request held; random chains against a reference."""
    k = 8
    index = PrefixIndex(prediction_stride=k)
    chain = [i.to_bytes(16, "big") for i in range(1, 41)]  # 40 blocks
    assert index.predict("r0", chain, now=0.0) == 5  # 7, 15, 23, 31, 39
    assert index.match(chain, now=0.0) == {"r0": 40}
    sibling = chain[:21] + [b"x" * 16] * 5  # diverges at block 21
    assert index.match(sibling, now=0.0) == {"r0": 16}  # loses 5 (< k) blocks of credit
    assert index.match(chain[:21], now=0.0) == {"r0": 16}  # its last block is no sample
    assert index.match(chain[:24], now=0.0) == {"r0": 24}
    assert index.predict("r1", chain[:19], now=0.0) == 3  # 7, 15 and its last, 18
    assert index.match(chain[:19], now=0.0) == {"r0": 16, "r1": 19}
    index.check_invariants()

    rng = random.Random(5)
    for _ in range(200):
        index = PrefixIndex(prediction_stride=k)
        base = [rng.randbytes(16) for _ in range(rng.randint(1, 40))]
        routed: dict[str, list[list[bytes]]] = {}
        for r in ("a", "b", "c"):
            for _ in range(rng.randint(0, 2)):
                req = base[: rng.randint(1, len(base))] + [rng.randbytes(16)] * rng.randint(0, 3)
                routed.setdefault(r, []).append(req)
                index.predict(r, req, now=0.0)
        held = {r: {h for req in reqs for h in req} for r, reqs in routed.items()}
        probe = base[: rng.randint(1, len(base))]
        assert index.match(probe, now=0.0) == reference_sampled(held, routed, probe, k)
        # Sound: never more than a routed request of that replica really shared.
        for r, n in index.match(probe, now=0.0).items():
            assert all(h in held[r] for h in probe[:n])


def reference_sampled(
    held: dict[str, set], routed: dict[str, list[list[bytes]]], probe: list[bytes], k: int
) -> dict[str, int]:
    """Leading blocks credited per replica: block i counts when the probe's sample at or
    after i (or its last block) is among the replica's requests' samples."""
    out = {}
    for r, reqs in routed.items():
        samples = {
            req[p] for req in reqs for p in range(len(req)) if (p + 1) % k == 0 or p == len(req) - 1
        }
        n = 0
        while n < len(probe) and probe[min(n + k - 1 - n % k, len(probe) - 1)] in samples:
            n += 1
        if n:
            out[r] = n
    return out
