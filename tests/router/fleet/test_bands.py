"""The waiting room's order and invariants (router/fleet/bands.py): random pushes, removals
and charges against a plain list kept beside it."""

from __future__ import annotations

import random

from kvroute.router.fleet.bands import Bands, Waiter


def waiter(band: int, tenant: str) -> Waiter:
    return Waiter(band, tenant, 1.0, lambda room: None, lambda: [])


def check(bands: Bands, model: list[Waiter]) -> None:
    assert len(bands) == len(model)
    want: dict[int, int] = {}
    for w in model:
        want[w.band] = want.get(w.band, 0) + 1
    assert bands.lengths() == want
    assert bands.order == sorted(want)
    for b in range(-1, 4):
        assert bands.ahead_of(b) == sum(n for band, n in want.items() if band <= b)
    assert all(w.queued for w in model)
    heads = list(bands.heads())
    # one head per (band, tenant), each its tenant's oldest in that band, bands most urgent
    # first
    firsts = {}
    for w in sorted(model, key=lambda w: w.seq):
        firsts.setdefault((w.band, w.tenant), w)
    assert sorted(heads, key=lambda w: w.seq) == sorted(firsts.values(), key=lambda w: w.seq)
    assert [h.band for h in heads] == sorted(h.band for h in heads)


def test_random_operations_keep_the_invariants() -> None:
    rng = random.Random(0)
    bands, model = Bands(), []
    for _ in range(3000):
        op = rng.random()
        if op < 0.5 or not model:
            w = waiter(rng.randrange(3), rng.choice("abcd"))
            bands.push(w)
            model.append(w)
        elif op < 0.8:
            w = model.pop(rng.randrange(len(model)))
            bands.remove(w)
            assert not w.queued
        else:
            bands.charge(rng.choice("abcd"), rng.random() * 100)
        check(bands, model)
    for w in list(model):
        bands.remove(w)
        model.remove(w)
    check(bands, model)
    assert bands._counter == {}  # nothing waits: no counter is kept


def test_in_a_band_the_least_served_tenant_goes_first_and_a_newcomer_is_not_in_credit() -> None:
    bands = Bands()
    a1, a2, b1 = waiter(0, "a"), waiter(0, "a"), waiter(0, "b")
    for w in (a1, a2, b1):
        bands.push(w)
    assert [h.tenant for h in bands.heads()] == ["a", "b"]  # equal counters: older head
    bands.remove(a1)
    bands.charge("a", 100.0)  # a dispatched while others wait
    assert [h.tenant for h in bands.heads()] == ["b", "a"]
    bands.remove(b1)
    bands.push(c := waiter(0, "c"))  # starts waiting: lifted to the least waiting counter
    assert bands._counter["c"] == bands._counter["a"] == 100.0
    assert [h for h in bands.heads()] == [a2, c]  # tie: the older head
    urgent = waiter(-1, "z")
    bands.push(urgent)
    assert next(bands.heads()) is urgent  # a more urgent band before any counter
