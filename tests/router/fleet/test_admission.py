"""Admission: tickets against the tenant's share, the router's budget and its queue, and
the tenant's rates -- each given back exactly once, a refusal changing nothing."""

from __future__ import annotations

import asyncio

import pytest

from kvroute.router.fleet.admission import Admission, OverloadedError
from kvroute.router.fleet.tenants import Limits, Tenant

from ...waiting import wait_until


def tenant(name: str, **limits: int) -> Tenant:
    return Tenant(name, f"salt-{name}", Limits(**limits))


async def test_a_ticket_is_released_once_however_often_release_is_called() -> None:
    adm = Admission(max_in_flight=2)
    a = tenant("a")
    t1, t2 = await adm.admit(a), await adm.admit(a)
    assert adm.in_flight == 2 and adm.tenant_in_flight("a") == 2
    adm.release(t1)
    adm.release(t1)  # a second release (two ways of ending one request) is a no-op
    assert adm.in_flight == 1 and adm.tenant_in_flight("a") == 1
    adm.release(t2, output_tokens=5)
    assert adm.in_flight == 0 and adm.tenant_in_flight("a") == 0


async def test_a_tenant_at_its_concurrency_limit_is_refused_and_nothing_is_counted() -> None:
    adm = Admission(max_in_flight=10)
    a, b = tenant("a", max_concurrent=1), tenant("b")
    held = await adm.admit(a)
    with pytest.raises(OverloadedError, match="1 requests in flight"):
        await adm.admit(a)
    assert adm.in_flight == 1 and adm.tenant_in_flight("a") == 1
    assert adm.errors["tenant_overloaded"] == 1
    await adm.admit(b)  # another tenant is admitted meanwhile
    adm.release(held)
    await adm.admit(a)  # its slot is back


async def test_past_the_budget_the_oldest_waiter_gets_the_freed_slot() -> None:
    adm = Admission(max_in_flight=1, queue=2, timeout_s=5.0)
    a = tenant("a")
    first = await adm.admit(a)
    order: list[str] = []

    async def wait(name: str) -> None:
        ticket = await adm.admit(a)
        order.append(name)
        adm.release(ticket)

    waiters = [asyncio.create_task(wait("w1")), asyncio.create_task(wait("w2"))]
    await wait_until(lambda: adm.waiting == 2, 20, "both waiters queued")
    with pytest.raises(OverloadedError, match="waiting"):  # the queue is full: refused
        await adm.admit(a)
    adm.release(first)
    await asyncio.gather(*waiters)
    assert order == ["w1", "w2"] and adm.in_flight == 0 and adm.tenant_in_flight("a") == 0


async def test_a_waiter_that_times_out_gives_its_share_back() -> None:
    adm = Admission(max_in_flight=1, queue=1, timeout_s=0.05)
    a = tenant("a")
    held = await adm.admit(a)
    with pytest.raises(OverloadedError, match="waited"):
        await adm.admit(a)
    assert adm.tenant_in_flight("a") == 1 and adm.in_flight == 1 and adm.waiting == 0
    adm.release(held)
    assert adm.in_flight == 0


async def test_a_tenant_in_token_debt_is_refused_at_the_door() -> None:
    adm = Admission()
    a = tenant("a", tokens_per_minute=60)
    ticket = await adm.admit(a)
    adm.charge(ticket, 100)  # its prompt, known after tokenizing: 40 in debt
    adm.release(ticket, output_tokens=10)  # and its output: 50 in debt
    with pytest.raises(OverloadedError, match="60 tokens per minute") as info:
        await adm.admit(a)
    assert info.value.retry_after_s == pytest.approx(50.0, abs=0.1)
    assert adm.in_flight == 0 and adm.tenant_in_flight("a") == 0  # the refusal took nothing


def test_the_most_a_tenant_can_ever_hold_is_its_cap_or_the_budget() -> None:
    """What a request of several choices is checked against before any ticket is taken."""
    assert Admission().concurrency_cap(tenant("a")) is None
    assert Admission(max_in_flight=8).concurrency_cap(tenant("a")) == 8
    assert Admission(max_in_flight=8).concurrency_cap(tenant("a", max_concurrent=3)) == 3
    assert Admission(max_in_flight=8, max_in_flight_per_tenant=4).concurrency_cap(tenant("a")) == 4
    assert Admission(max_in_flight=2).concurrency_cap(tenant("a", max_concurrent=5)) == 2


async def test_a_fleet_that_grows_lets_its_waiters_in_and_one_that_shrinks_admits_less() -> None:
    """resize (kvroute scale): a larger budget hands its room to the queued requests at
    once; a smaller one keeps what is admitted and admits no more until below it."""
    adm = Admission(max_in_flight=1, max_in_flight_per_tenant=1, queue=4, timeout_s=20.0)
    a, b = tenant("a"), tenant("b")
    held = await adm.admit(a)
    waiter = asyncio.create_task(adm.admit(b))
    await wait_until(lambda: adm.waiting == 1, 20, "b queued")
    adm.resize(3, 2, 8)
    second = await asyncio.wait_for(waiter, 5)  # let in without any release
    assert adm.in_flight == 2 and adm.shares.cap == 2 and adm.queue.max_waiting == 8
    await adm.admit(a)  # the tenant cap grew with it: a holds two
    adm.resize(1, 1, 0)
    assert adm.in_flight == 3  # nothing admitted is taken back
    with pytest.raises(OverloadedError, match="this tenant"):
        await adm.admit(b)  # b holds its (new) cap of one
    with pytest.raises(OverloadedError, match="0 waiting"):
        await adm.admit(tenant("c"))  # a newcomer finds the smaller budget full, no queue
    adm.release(held)
    adm.release(second)
    assert adm.in_flight == 1
