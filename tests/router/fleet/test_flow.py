"""Flow control's queue (router/fleet/flow.py) on its own: fake sends, a fake clock."""

from __future__ import annotations

import asyncio

import pytest

from kvroute.router.fleet.flow import FlowControl, ShedError, Waiter


class Fleet:
    """Replicas and what was sent where, in order."""

    def __init__(self, flow: FlowControl, replicas: list[str]) -> None:
        self.flow = flow
        self.replicas = replicas
        self.sent: list[tuple[str, str]] = []  # (name, replica)

    def waiter(
        self,
        name: str,
        tenant: str = "t",
        band: int = 0,
        cost: float = 100,
        deadline: float | None = None,
        only: list[str] | None = None,
    ) -> Waiter:
        def dispatch(room: list[str] | None) -> None:
            choices = room if room is not None else self.eligible(only)
            if not choices:
                raise RuntimeError("no replica")
            rid = choices[0]
            self.flow.occupy(rid, 10)
            self.sent.append((name, rid))

        return Waiter(band, tenant, cost, dispatch, lambda: self.eligible(only), deadline)

    def eligible(self, only: list[str] | None) -> list[str]:
        return [r for r in self.replicas if only is None or r in only]

    def names(self) -> list[str]:
        return [n for n, _ in self.sent]


def run(coro_fn):  # type: ignore[no-untyped-def]
    return asyncio.run(coro_fn())


def test_sent_at_once_while_there_is_room() -> None:
    async def main() -> None:
        flow = FlowControl(depth=2)
        fleet = Fleet(flow, ["r0", "r1"])
        assert all(flow.submit(fleet.waiter(f"a{i}")) for i in range(4))
        assert [r for _, r in fleet.sent] == ["r0", "r0", "r1", "r1"]
        w = fleet.waiter("a4")
        assert not flow.submit(w)  # full: it waits
        assert flow.waiting == 1 and flow.lengths() == {0: 1}
        flow.vacate("r1", 10)  # a first token on r1: room, taken at once (work-conserving)
        assert w.future is not None and w.future.done() and fleet.sent[-1] == ("a4", "r1")
        assert flow.waiting == 0

    run(main)


def test_bands_go_most_urgent_first() -> None:
    async def main() -> None:
        flow = FlowControl(depth=1)
        fleet = Fleet(flow, ["r0"])
        assert flow.submit(fleet.waiter("first"))
        for name, band in (("batch1", 5), ("batch2", 5), ("normal", 0), ("urgent", -3)):
            assert not flow.submit(fleet.waiter(name, band=band))
        for _ in range(4):
            flow.vacate("r0", 10)
        assert fleet.names() == ["first", "urgent", "normal", "batch1", "batch2"]

    run(main)


def test_the_least_served_tenant_goes_first_fifo_within_it() -> None:
    async def main() -> None:
        flow = FlowControl(depth=1)
        fleet = Fleet(flow, ["r0"])
        assert flow.submit(fleet.waiter("x"))
        for i in range(5):  # a flood of a, queued first
            flow.submit(fleet.waiter(f"a{i}", "a"))
        flow.submit(fleet.waiter("b0", "b"))
        flow.submit(fleet.waiter("b1", "b"))
        for _ in range(7):
            flow.vacate("r0", 10)
        # b arrived after a's flood yet is served at a's pace: one each, a's older head first
        assert fleet.names() == ["x", "a0", "b0", "a1", "b1", "a2", "a3", "a4"]

    run(main)


def test_a_heavy_request_costs_its_tenant_more_turns() -> None:
    async def main() -> None:
        flow = FlowControl(depth=1)
        fleet = Fleet(flow, ["r0"])
        flow.submit(fleet.waiter("x"))
        flow.submit(fleet.waiter("big", "a", cost=1000))
        for i in range(3):
            flow.submit(fleet.waiter(f"a{i}", "a", cost=1000))
        for i in range(3):
            flow.submit(fleet.waiter(f"b{i}", "b", cost=100))
        for _ in range(7):
            flow.vacate("r0", 10)
        assert fleet.names()[:6] == ["x", "big", "b0", "b1", "b2", "a0"]

    run(main)


def test_a_head_without_room_is_passed_over() -> None:
    async def main() -> None:
        flow = FlowControl(depth=1)
        fleet = Fleet(flow, ["r0", "r1"])
        flow.submit(fleet.waiter("x0"))
        flow.submit(fleet.waiter("x1"))
        assert not flow.submit(fleet.waiter("lora", "a", band=-1, only=["r0"]))
        assert not flow.submit(fleet.waiter("base", "b"))
        flow.vacate("r1", 10)  # r1 has room: the lora head cannot use it, the other can
        assert fleet.sent[-1] == ("base", "r1")
        flow.vacate("r0", 10)
        assert fleet.sent[-1] == ("lora", "r0")

    run(main)


def test_tokens_bound_room_but_an_empty_replica_takes_anything() -> None:
    async def main() -> None:
        flow = FlowControl(depth=8, tokens=15)
        fleet = Fleet(flow, ["r0"])
        assert flow.submit(fleet.waiter("a"))  # 10 tokens
        assert flow.submit(fleet.waiter("b"))  # 20 now: past the bound
        assert not flow.submit(fleet.waiter("c"))
        flow.vacate("r0", 10)  # 10 left: room
        assert fleet.names() == ["a", "b", "c"]

    run(main)


def test_cancel_takes_it_out_and_nothing_is_sent() -> None:
    async def main() -> None:
        flow = FlowControl(depth=1)
        fleet = Fleet(flow, ["r0"])
        flow.submit(fleet.waiter("x"))
        w = fleet.waiter("gone")
        flow.submit(w)
        flow.cancel(w)
        flow.cancel(w)  # idempotent
        assert flow.waiting == 0 and flow.stats.cancelled == 1
        flow.vacate("r0", 10)
        assert fleet.names() == ["x"]

    run(main)


def test_a_full_band_is_refused_with_a_retry_after() -> None:
    async def main() -> None:
        flow = FlowControl(depth=1, max_waiting=2)
        fleet = Fleet(flow, ["r0"])
        flow.submit(fleet.waiter("x"))
        flow.submit(fleet.waiter("w0"))
        flow.submit(fleet.waiter("w1"))
        with pytest.raises(ShedError) as info:
            flow.submit(fleet.waiter("w2"))
        assert info.value.cause == "queue_full" and int(info.value.retry_after) >= 1
        assert not flow.submit(fleet.waiter("other band", band=1))  # its own bound
        assert flow.stats.shed == {(0, "queue_full"): 1}

    run(main)


def test_a_deadline_that_cannot_be_met_is_refused_at_once() -> None:
    async def main() -> None:
        now = [100.0]
        flow = FlowControl(depth=1, clock=lambda: now[0])
        fleet = Fleet(flow, ["r0"])
        for i in range(5):  # 5 dispatches over 4 s: 1.25 per second
            flow.submit(fleet.waiter(f"d{i}"))
            now[0] += 1.0
            if i < 4:
                flow.vacate("r0", 10)
        now[0] -= 1.0
        for i in range(4):
            flow.submit(fleet.waiter(f"q{i}"))
        assert flow.estimated_wait(0) == pytest.approx(4 / 1.25)
        with pytest.raises(ShedError) as info:
            flow.submit(fleet.waiter("late", deadline=now[0] + 1.0))
        assert info.value.cause == "deadline" and info.value.retry_after == "4"
        # a more urgent band has nothing ahead of it: its deadline can be met
        assert not flow.submit(fleet.waiter("urgent", band=-1, deadline=now[0] + 1.0))

    run(main)


def test_a_deadline_that_passes_while_queued_is_a_429() -> None:
    async def main() -> None:
        flow = FlowControl(depth=1)
        fleet = Fleet(flow, ["r0"])
        flow.submit(fleet.waiter("x"))
        loop = asyncio.get_running_loop()
        w = fleet.waiter("late", deadline=flow.clock() + 0.05)
        assert not flow.submit(w)
        assert w.future is not None
        with pytest.raises(ShedError, match="passed while it waited"):
            await asyncio.wait_for(w.future, 2)
        assert flow.waiting == 0 and flow.stats.shed == {(0, "deadline"): 1}
        assert loop.is_running()

    run(main)


def test_no_replica_left_fails_the_waiters_instead_of_holding_them() -> None:
    async def main() -> None:
        flow = FlowControl(depth=1)
        fleet = Fleet(flow, ["r0"])
        flow.submit(fleet.waiter("x"))
        w = fleet.waiter("w")
        flow.submit(w)
        fleet.replicas.clear()  # r0 died
        flow.wake("r0")
        assert w.future is not None
        with pytest.raises(RuntimeError, match="no replica"):
            await w.future
        assert flow.waiting == 0

    run(main)


def test_the_sweep_sends_what_a_change_unseen_made_room_for() -> None:
    async def main() -> None:
        flow = FlowControl(depth=1)
        fleet = Fleet(flow, ["r0"])
        flow.submit(fleet.waiter("x"))
        w = fleet.waiter("w")
        flow.submit(w)
        fleet.replicas.append("r1")  # joined, nobody told the queue
        assert w.future is not None
        await asyncio.wait_for(w.future, 3)
        assert fleet.sent[-1] == ("w", "r1")

    run(main)


def test_every_waiter_leaves_exactly_once_under_churn() -> None:
    """A random mix of submits, first tokens, cancels and deadlines: every waiter ends
    sent, cancelled or shed, once; the counts agree; nothing waits at the end."""
    import random

    async def main() -> None:
        rng = random.Random(7)
        flow = FlowControl(depth=2, max_waiting=20)
        fleet = Fleet(flow, ["r0", "r1", "r2"])
        waiters: list[Waiter] = []
        held: list[str] = []
        outcomes = {"sent": 0, "cancelled": 0, "shed": 0}
        submitted = 0
        for i in range(400):
            op = rng.random()
            if op < 0.5:
                deadline = flow.clock() + rng.choice([0.001, 5.0]) if rng.random() < 0.2 else None
                w = fleet.waiter(f"w{i}", rng.choice("abc"), rng.randint(-1, 1), deadline=deadline)
                submitted += 1
                try:
                    if flow.submit(w):
                        outcomes["sent"] += 1
                        held.append(fleet.sent[-1][1])
                    else:
                        waiters.append(w)
                except ShedError:
                    outcomes["shed"] += 1
            elif op < 0.85 and held:
                before = len(fleet.sent)
                flow.vacate(held.pop(rng.randrange(len(held))), 10)
                held += [r for _, r in fleet.sent[before:]]
            elif waiters:
                flow.cancel(waiters[rng.randrange(len(waiters))])
            await asyncio.sleep(0)
        while flow.waiting:
            before = len(fleet.sent)
            flow.vacate(held.pop(), 10)
            held += [r for _, r in fleet.sent[before:]]
            await asyncio.sleep(0)
        for w in waiters:
            assert w.future is not None and w.future.done() and not w.queued
            if w.future.cancelled():
                outcomes["cancelled"] += 1
            elif w.future.exception() is not None:
                outcomes["shed"] += 1
            else:
                outcomes["sent"] += 1
        assert outcomes["sent"] == len(fleet.sent) == sum(flow.stats.dispatched.values())
        assert outcomes["shed"] == sum(flow.stats.shed.values())
        assert outcomes["cancelled"] == flow.stats.cancelled
        assert sum(outcomes.values()) == submitted

    run(main)


def test_other_front_doors_requests_count_against_the_depth() -> None:
    async def main() -> None:
        others = {"r0": 2, "r1": 0}
        flow = FlowControl(depth=2, others=lambda r: others[r])
        fleet = Fleet(flow, ["r0", "r1"])
        assert flow.submit(fleet.waiter("a"))
        assert fleet.sent == [("a", "r1")]  # r0 is full of another front door's requests
        flow.submit(fleet.waiter("b"))
        w = fleet.waiter("c")
        assert not flow.submit(w)
        others["r0"] = 0  # its load report says they started: the sweep sees it
        assert w.future is not None
        await asyncio.wait_for(w.future, 3)
        assert fleet.sent[-1] == ("c", "r0")

    run(main)
