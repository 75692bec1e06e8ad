"""A hot prefix through the real index and kv policy: one replica while that is cheapest,
copies once its holder is loaded, hits kept near the pooled bound either way."""

from __future__ import annotations

import numpy as np
import pytest

from kvroute.sim.bounds import bounds
from kvroute.sim.report import router_hashes, summarize
from kvroute.sim.simulator import SimConfig, SimRun
from kvroute.sim.workloads import RequestSpec, TokenSource

HOT = (1, 4096)  # (segment id, tokens): the prefix half of the traffic shares


def hot_workload(n: int, rate: float, seed: int = 0) -> list[RequestSpec]:
    """Half the requests start with HOT, the rest are cold; every suffix is unique."""
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.exponential(1.0 / rate, size=n))
    out = []
    for i, t in enumerate(times):
        own = (1000 + i, 256)
        segs = (HOT, own) if i % 2 == 0 else ((100_000 + i, 4096), own)
        out.append(RequestSpec(float(t), segs, 128))
    return out


def run(rate: float, n: int) -> tuple[SimRun, dict, dict]:
    specs = hot_workload(n, rate)
    cfg = SimConfig(replicas=4, block_size=64, blocks_per_replica=4000)
    src = TokenSource()
    hashes = router_hashes(specs, cfg, src)
    fleet = SimRun(specs, "kv", cfg, src, hashes).run()
    return fleet, summarize(fleet, 0.0), bounds(specs, hashes, cfg, src)


def holders(fleet: SimRun) -> set[int]:
    return {r.replica for r in fleet.reqs if r is not None and r.spec.segments[0] == HOT}


def test_at_low_load_the_hot_prefix_stays_on_one_replica():
    fleet, summary, bound = run(rate=2.0, n=200)
    assert len(holders(fleet)) == 1  # never copied for nothing
    assert summary["hit_rate"] >= 0.9 * bound["pooled_hit_rate"]


@pytest.mark.slow
def test_at_high_load_it_spreads_over_several_holders_and_keeps_its_hits():
    fleet, summary, bound = run(rate=120.0, n=3000)
    hot = holders(fleet)
    assert len(hot) >= 2, hot
    assert summary["hit_rate"] >= 0.9 * bound["pooled_hit_rate"]
    assert summary["imbalance"] <= 1.3
