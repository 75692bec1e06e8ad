"""Per-tenant limits and the admission queue: buckets and shares on a clock the test
moves, and the queue's order, reservations and bounds on a real event loop."""

from __future__ import annotations

import asyncio

import pytest

from kvroute.router.fleet.admission import (
    AdmissionQueue,
    OverloadedError,
    RateLimits,
    TenantShares,
    TokenBucket,
)
from kvroute.router.fleet.tenants import Limits

from ...waiting import wait_until


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_requests_per_minute_is_a_bucket_of_one_minutes_worth() -> None:
    clock = Clock()
    rates, limits = RateLimits(clock), Limits(requests_per_minute=3)
    for _ in range(3):  # a burst up to the minute's allowance
        rates.admit("t", limits, 10)
    with pytest.raises(OverloadedError, match="3 requests per minute") as info:
        rates.admit("t", limits, 10)
    assert info.value.retry_after_s == pytest.approx(20.0)  # one request's worth
    assert info.value.retry_after == "20"
    rates.admit("other", limits, 10)  # another tenant has its own bucket
    clock.t += 19.9
    with pytest.raises(OverloadedError):
        rates.admit("t", limits, 10)
    clock.t += 0.1
    rates.admit("t", limits, 10)
    clock.t += 3600  # refilled, never beyond one minute's worth
    for _ in range(3):
        rates.admit("t", limits, 10)
    with pytest.raises(OverloadedError):
        rates.admit("t", limits, 10)


def test_tokens_per_minute_charges_prompts_at_once_and_outputs_at_the_end() -> None:
    clock = Clock()
    rates, limits = RateLimits(clock), Limits(tokens_per_minute=120)  # 2 tokens a second
    rates.admit("t", limits, 100)  # 20 left
    rates.admit("t", limits, 100)  # admitted while positive: 80 in debt
    with pytest.raises(OverloadedError, match="120 tokens per minute") as info:
        rates.admit("t", limits, 1)
    assert info.value.retry_after_s == pytest.approx(40.0, abs=1e-6)
    clock.t += 41
    rates.admit("t", limits, 0)  # 2 left
    rates.charge("t", 50)  # its output: 48 in debt
    with pytest.raises(OverloadedError) as info:
        rates.admit("t", limits, 0)
    assert info.value.retry_after_s == pytest.approx(24.0, abs=1e-6)
    rates.charge("untracked", 10**6)  # a tenant without a token limit: nothing to charge


def test_a_refused_request_takes_nothing() -> None:
    clock = Clock()
    rates = RateLimits(clock)
    both = Limits(requests_per_minute=60, tokens_per_minute=60)
    rates.admit("t", both, 61)  # tokens: -1; requests: 59 left
    for _ in range(5):
        with pytest.raises(OverloadedError, match="tokens per minute"):
            rates.admit("t", both, 1)
    clock.t += 2  # tokens back to +1; requests refilled to the cap (the refusals took none)
    rates.admit("t", both, 0)
    requests_left, tokens_left = rates.levels("t")
    assert requests_left == pytest.approx(59.0)  # 54 had they taken requests
    assert tokens_left == pytest.approx(1.0)


def test_bucket_never_banks_more_than_a_minute() -> None:
    b = TokenBucket(60, now=0.0)
    b.level = 0.0
    b.refill(10_000.0)
    assert b.level == 60.0 and b.wait_s(60.0, 10_000.0) == 0.0 and b.wait_s(61.0, 10_000.0) == 1.0


def test_a_tenants_own_concurrency_limit_replaces_the_default_cap() -> None:
    shares = TenantShares(cap=2)
    own = Limits(max_concurrent=3)
    assert [shares.admit("a") for _ in range(3)] == [True, True, False]
    assert [shares.admit("b", own) for _ in range(4)] == [True, True, True, False]
    shares.release("a")
    assert shares.admit("a") and shares.in_flight("a") == 2 and shares.in_flight("b") == 3
    with pytest.raises(ValueError):
        Limits(max_concurrent=0)


def test_the_queue_serves_waiters_first_come_first_served_and_holds_their_slots() -> None:
    async def main() -> None:
        budget, running = 2, {"n": 2}  # the budget is full
        q = AdmissionQueue(max_waiting=3, timeout_s=5)

        def room() -> bool:
            return running["n"] + q.reserved < budget

        order: list[int] = []

        async def request(i: int) -> None:
            await q.wait(room, budget)
            running["n"] += 1  # routed in the same tick, as the front door does
            order.append(i)

        tasks = [asyncio.create_task(request(i)) for i in range(3)]
        await wait_until(lambda: q.waiting == 3, 20, "three queued")
        assert order == []
        with pytest.raises(OverloadedError, match="3 waiting"):  # the queue is full
            await q.wait(room, budget)
        running["n"] -= 1  # one ends: its slot goes to the oldest waiter, held for it
        q.wake(room)
        assert q.reserved == 1 and q.waiting == 2
        late = asyncio.create_task(request(99))  # a newcomer queues behind the others
        await wait_until(lambda: order == [0] and q.waiting == 3, 20, "the oldest let in")
        assert q.reserved == 0
        running["n"] -= 2
        q.wake(room)
        await wait_until(lambda: len(order) == 3, 20, "two more let in")
        assert order == [0, 1, 2]
        running["n"] -= 1
        q.wake(room)
        await asyncio.gather(*tasks, late)
        assert order == [0, 1, 2, 99] and q.waiting == 0 and q.reserved == 0

    asyncio.run(main())


def test_a_waiter_that_times_out_is_refused_and_leaves_nothing_behind() -> None:
    async def main() -> None:
        q = AdmissionQueue(max_waiting=4, timeout_s=0.05)
        with pytest.raises(OverloadedError, match=r"waited 0\.05 s"):
            await q.wait(lambda: False, 1)
        assert q.waiting == 0 and q.reserved == 0
        assert await q.wait(lambda: True, 1) is None  # room and nobody waiting: at once

    asyncio.run(main())
