"""Flow control in the simulator (sim/door.py): requests wait at the door while no replica
has room, no replica ever holds more than the door allows without a first token, nothing is
lost (faults included), and TTFT counts the wait at the door."""

from __future__ import annotations

import pytest

from kvroute.sim.door import Door
from kvroute.sim.report import router_hashes
from kvroute.sim.simulator import Fault, SimConfig, SimRun
from kvroute.sim.workloads import TokenSource, make_workload


def test_room_follows_the_request_and_token_bounds() -> None:
    door = Door(depth=2, tokens=100)
    assert door.room(["a", "b"]) == ["a", "b"]
    door.occupy(1, "a", 500)  # an empty replica takes any prompt
    assert not door.has_room("a") and door.has_room("b")  # past its tokens
    door.occupy(2, "b", 10)
    door.occupy(3, "b", 10)
    assert door.room(["a", "b"]) == []  # a: tokens; b: depth
    assert door.vacate(1) and not door.vacate(1)  # a slot is given back once
    assert door.room(["a", "b"]) == ["a"]
    door.occupy(2, "a", 10)  # a request moved: its old slot goes
    assert door.pending == {"a": 1, "b": 1}
    door.check_invariants()
    with pytest.raises(ValueError):
        Door(0, 10)


class Watched(SimRun):
    """Records the most requests any replica held from the door without a first token."""

    most = 0

    def _send(self, req, view):  # type: ignore[no-untyped-def]
        sent = super()._send(req, view)
        assert self.door is not None
        self.door.check_invariants()
        self.most = max(self.most, *self.door.pending.values(), 0)
        return sent


def run(specs, cfg: SimConfig, cls: type[SimRun] = SimRun) -> SimRun:
    src = TokenSource()
    return cls(specs, "kv", cfg, src, router_hashes(specs, cfg, src)).run()


@pytest.mark.parametrize("faults", [(), (Fault(5.0, 1, "down"), Fault(12.0, 1, "up"))])
def test_an_overloaded_fleet_queues_at_the_door_and_loses_nothing(faults: tuple) -> None:
    specs = make_workload("rag", 300, seed=6, speed=12.0)  # far past what 3 replicas serve
    cfg = SimConfig(replicas=3, block_size=64, flow_depth=2, flow_tokens=4096, faults=faults)
    f = run(specs, cfg, Watched)
    assert f.door is not None and f.door.num_waited > 50
    assert f.most <= 2  # never more than the depth without a first token
    assert not f.door.waiting and not f.door.holding  # all gone through, all slots back
    done = [r for r in f.reqs if r is not None and r.done_s is not None]
    assert len(done) == len(specs) - f.rejected
    for r in done:
        assert r.first_s is not None and r.first_s >= r.spec.arrival_s


def test_the_door_s_wait_is_part_of_ttft_and_the_replicas_queues_stay_short() -> None:
    specs = make_workload("rag", 300, seed=6, speed=12.0)
    held = run(specs, SimConfig(replicas=3, block_size=64, flow_depth=2))
    free = run(specs, SimConfig(replicas=3, block_size=64))
    # Without the door, requests queue in the engines (admitted late); with it, at the door.
    late = [r.scheduled_s - r.spec.arrival_s for r in free.reqs if r and r.scheduled_s]
    held_late = [r.scheduled_s - r.spec.arrival_s for r in held.reqs if r and r.scheduled_s]
    assert max(held_late) >= 0.5 * max(late)  # the wait moved, it did not vanish
    assert held.decode_tokens == free.decode_tokens  # the same work, all of it


def test_flow_control_off_routes_on_arrival_as_before() -> None:
    specs = make_workload("tenants", 150, seed=2, speed=3.0)
    f = run(specs, SimConfig(replicas=3, block_size=64))
    assert f.door is None
