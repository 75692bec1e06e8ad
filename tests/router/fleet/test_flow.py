"""Flow control's queue (router/fleet/flow.py) on its own: fake sends, a fake clock."""

from __future__ import annotations

import asyncio

import pytest

from kvroute.router.fleet.bands import Waiter
from kvroute.router.fleet.flow import FlowControl, ShedError
from kvroute.router.fleet.tenants import PRIORITY_MIN


class Fleet:
    """Replicas, what was sent where (in order), and the slots held (oldest first)."""

    def __init__(self, flow: FlowControl, replicas: list[str]) -> None:
        self.flow = flow
        self.replicas = replicas
        self.sent: list[tuple[str, str]] = []  # (name, replica)
        self.held: list[tuple[str, int, str]] = []  # (replica, band, tenant)

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
            self.flow.occupy(rid, 10, band, tenant)
            self.held.append((rid, band, tenant))
            self.sent.append((name, rid))

        return Waiter(band, tenant, cost, dispatch, lambda: self.eligible(only), deadline)

    def block(self, rid: str, slots: int) -> None:
        """``slots`` of the most urgent work on ``rid``: room for nobody."""
        for _ in range(slots):
            self.flow.occupy(rid, 0, PRIORITY_MIN, "blocker")
            self.held.append((rid, PRIORITY_MIN, "blocker"))

    def first_token(self, rid: str | None = None) -> None:
        """The oldest slot held (on ``rid``) gets its first token."""
        i = next(i for i, h in enumerate(self.held) if rid is None or h[0] == rid)
        r, band, tenant = self.held.pop(i)
        self.flow.vacate(r, 0 if tenant == "blocker" else 10, band, tenant)

    def drain(self) -> None:
        while self.held:
            self.first_token()

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
        fleet.first_token("r1")  # room on r1, taken at once (work-conserving)
        assert w.future is not None and w.future.done() and fleet.sent[-1] == ("a4", "r1")
        assert flow.waiting == 0

    run(main)


def test_less_urgent_work_never_holds_a_request_back() -> None:
    async def main() -> None:
        flow = FlowControl(depth=1)
        fleet = Fleet(flow, ["r0"])
        for i in range(2):
            flow.submit(fleet.waiter(f"batch{i}", f"b{i}", band=5))
        assert not flow.submit(fleet.waiter("batch2", "b2", band=5))
        assert flow.submit(fleet.waiter("urgent", band=0))  # sent beside them at once
        assert fleet.sent[-1] == ("urgent", "r0")

    run(main)


def test_bands_go_most_urgent_first() -> None:
    async def main() -> None:
        flow = FlowControl(depth=1)
        fleet = Fleet(flow, ["r0"])
        fleet.block("r0", 2)
        for name, band in (("batch1", 5), ("batch2", 5), ("normal", 0), ("urgent", -3)):
            assert not flow.submit(fleet.waiter(name, band=band))
        fleet.drain()
        assert fleet.names() == ["urgent", "normal", "batch1", "batch2"]

    run(main)


def test_the_least_served_tenant_goes_first_fifo_within_it() -> None:
    async def main() -> None:
        flow = FlowControl(depth=1)
        fleet = Fleet(flow, ["r0"])
        fleet.block("r0", 2)
        for i in range(5):  # a flood of a, queued first
            flow.submit(fleet.waiter(f"a{i}", "a"))
        flow.submit(fleet.waiter("b0", "b"))
        flow.submit(fleet.waiter("b1", "b"))
        fleet.drain()
        # b came after a's flood yet is served at a's pace: turn about, a's older head first
        assert fleet.names() == ["a0", "b0", "a1", "b1", "a2", "a3", "a4"]

    run(main)


def test_a_heavy_request_costs_its_tenant_more_turns() -> None:
    async def main() -> None:
        flow = FlowControl(depth=3)
        fleet = Fleet(flow, ["r0"])
        fleet.block("r0", 6)
        for i in range(4):
            flow.submit(fleet.waiter(f"a{i}", "a", cost=1000))
        for i in range(4):
            flow.submit(fleet.waiter(f"b{i}", "b", cost=100))
        fleet.drain()
        order = fleet.names()
        assert order.index("b3") < order.index("a2")  # b's four cost less than a's second

    run(main)


def test_a_light_tenants_first_request_goes_beside_a_flood() -> None:
    async def main() -> None:
        flow = FlowControl(depth=2)
        fleet = Fleet(flow, ["r0"])
        for i in range(3):
            flow.submit(fleet.waiter(f"a{i}", "a"))
        assert fleet.names() == ["a0", "a1"]  # a waits at the door past the depth
        flow.submit(fleet.waiter("b0", "b"))  # b has nothing there: in beside it
        flow.submit(fleet.waiter("b1", "b"))  # its second waits its turn
        flow.submit(fleet.waiter("c0", "c"))  # c's first: in, up to twice the depth
        flow.submit(fleet.waiter("d0", "d"))  # past that, it waits too
        assert fleet.names() == ["a0", "a1", "b0", "c0"] and flow.waiting == 3

    run(main)


def test_a_head_without_room_is_passed_over() -> None:
    async def main() -> None:
        flow = FlowControl(depth=1)
        fleet = Fleet(flow, ["r0", "r1"])
        fleet.block("r0", 2)
        fleet.block("r1", 2)
        assert not flow.submit(fleet.waiter("lora", "a", band=-1, only=["r0"]))
        assert not flow.submit(fleet.waiter("base", "b"))
        fleet.first_token("r1")
        fleet.first_token("r1")  # r1 has room: the lora head cannot use it, the other can
        assert fleet.sent == [("base", "r1")]
        fleet.first_token("r0")
        assert fleet.sent[-1] == ("lora", "r0")

    run(main)


def test_tokens_bound_room_but_an_empty_replica_takes_anything() -> None:
    async def main() -> None:
        flow = FlowControl(depth=8, tokens=15)
        fleet = Fleet(flow, ["r0"])
        assert flow.submit(fleet.waiter("a"))  # 10 tokens
        assert flow.submit(fleet.waiter("b"))  # 20 now: past the bound
        assert not flow.submit(fleet.waiter("c"))
        fleet.first_token()  # 10 left: room
        assert fleet.names() == ["a", "b", "c"]

    run(main)


def test_cancel_takes_it_out_and_nothing_is_sent() -> None:
    async def main() -> None:
        flow = FlowControl(depth=1)
        fleet = Fleet(flow, ["r0"])
        fleet.block("r0", 2)
        w = fleet.waiter("gone")
        flow.submit(w)
        flow.cancel(w)
        flow.cancel(w)  # idempotent
        assert flow.waiting == 0 and flow.stats.cancelled == 1
        fleet.drain()
        assert fleet.names() == []

    run(main)


def test_a_full_band_is_refused_with_a_retry_after() -> None:
    async def main() -> None:
        flow = FlowControl(depth=1, max_waiting=2)
        fleet = Fleet(flow, ["r0"])
        fleet.block("r0", 2)
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
                fleet.first_token()
        now[0] -= 1.0
        for i in range(4):
            flow.submit(fleet.waiter(f"q{i}"))
        assert flow.estimated_wait(0) == pytest.approx(4 / 1.25)
        with pytest.raises(ShedError) as info:
            flow.submit(fleet.waiter("late", deadline=now[0] + 1.0))
        assert info.value.cause == "deadline" and info.value.retry_after == "4"
        # a more urgent band has nothing ahead of it: sent at once, beside less urgent work
        assert flow.submit(fleet.waiter("urgent", band=-1, deadline=now[0] + 1.0))

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


def learn_one_second_per_position(fleet: Fleet, now: list[float], rid: str) -> None:
    """Four requests sent to an empty ``rid``, each with its first token a second later:
    the engine's time per position is 1 s."""
    for i in range(4):
        assert fleet.flow.submit(fleet.waiter(f"learn{i}", only=[rid]))
        now[0] += 1.0
        fleet.first_token(rid)
    assert fleet.flow.slot_time() == pytest.approx(1.0)


def test_the_engines_time_per_position_is_a_high_quantile_of_recent_samples() -> None:
    """Admitted on an estimate most requests meet, not the mean (which half miss); old
    samples age out, and with too few there is no estimate (nothing refused on it)."""

    async def main() -> None:
        now = [100.0]
        flow = FlowControl(depth=16, clock=lambda: now[0])
        fleet = Fleet(flow, ["r0"])
        assert flow.slot_time() is None
        for i, secs in enumerate([0.1] * 8 + [0.5, 1.0]):  # one at a time: position 1
            assert flow.submit(fleet.waiter(f"s{i}"))
            now[0] += secs
            fleet.first_token()
        assert flow.slot_time() == pytest.approx(0.5)  # the 90th percentile of ten
        for i in range(2):  # two behind each other: the second waited 2 x 0.2 s
            assert flow.submit(fleet.waiter(f"p{i}"))
        now[0] += 0.2
        fleet.first_token()
        now[0] += 0.2
        fleet.first_token()
        assert flow._slot_samples[-1][1] == pytest.approx(0.2)  # 0.4 s over position 2
        now[0] += 11.0  # past RATE_WINDOW_S: forgotten
        assert flow.slot_time() is None

    run(main)


def test_a_deadline_is_checked_against_the_replicas_queues() -> None:
    """Room at the door is not enough: a request with a deadline goes only where the
    requests queued ahead of it in the engine leave time for its first token, and is
    refused at once when no replica with room does (it would have been served late)."""

    async def main() -> None:
        now = [100.0]
        flow = FlowControl(depth=16, clock=lambda: now[0])
        fleet = Fleet(flow, ["r0", "r1"])
        learn_one_second_per_position(fleet, now, "r0")
        assert flow.engine_wait("r0", 0) == pytest.approx(1.0)
        fleet.block("r0", 0)
        for i in range(3):  # three queued on r0, none on r1
            assert flow.submit(fleet.waiter(f"q{i}", only=["r0"]))
        assert flow.engine_wait("r0", 0) == pytest.approx(4.0)
        assert flow.submit(fleet.waiter("a", deadline=now[0] + 1.5))
        assert fleet.sent[-1] == ("a", "r1")  # r0 has room, but its first token would be late
        with pytest.raises(ShedError) as info:  # r0 only: refused at once, not sent late
            flow.submit(fleet.waiter("b", deadline=now[0] + 1.5, only=["r0"]))
        assert info.value.cause == "deadline" and info.value.retry_after == "4"
        assert fleet.names()[-1] == "a" and flow.waiting == 0
        assert flow.stats.shed == {(0, "deadline"): 1}
        # no deadline, or one the queue leaves time for: sent there as before
        assert flow.submit(fleet.waiter("c", only=["r0"]))
        assert flow.submit(fleet.waiter("d", deadline=now[0] + 10.0, only=["r0"]))
        assert fleet.names()[-2:] == ["c", "d"]

    run(main)


def test_a_waiter_whose_turn_comes_too_late_for_its_deadline_is_refused() -> None:
    """Checked again at dispatch: a waiter whose turn comes when even the replica with
    room would give it its first token past its deadline gets the 429 then, unsent; a
    waiter the estimate says waits too long is refused when it arrives."""

    async def main() -> None:
        now = [100.0]
        flow = FlowControl(depth=1, clock=lambda: now[0])
        fleet = Fleet(flow, ["r0"])
        learn_one_second_per_position(fleet, now, "r0")
        assert flow.submit(fleet.waiter("x"))
        w = fleet.waiter("w", deadline=now[0] + 1.5)
        assert not flow.submit(w)  # 1 s queued in r0, then its own second: in time
        with pytest.raises(ShedError, match="cannot be met"):  # behind w at the door, then
            flow.submit(fleet.waiter("v", deadline=now[0] + 1.5))  # a second in r0: too late
        now[0] += 0.8
        fleet.first_token()  # x started; w's turn, but 1 s from now is past its deadline
        assert w.future is not None and w.future.done()
        with pytest.raises(ShedError, match="can no longer be met"):
            w.future.result()
        assert fleet.names()[-1] == "x" and flow.waiting == 0
        assert flow.stats.shed == {(0, "deadline"): 2}

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
                    else:
                        waiters.append(w)
                except ShedError:
                    outcomes["shed"] += 1
            elif op < 0.85 and fleet.held:
                fleet.first_token(fleet.held[rng.randrange(len(fleet.held))][0])
            elif waiters:
                flow.cancel(waiters[rng.randrange(len(waiters))])
            await asyncio.sleep(0)
        while flow.waiting:
            fleet.first_token()
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
        others = {"r0": 4, "r1": 0}
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
