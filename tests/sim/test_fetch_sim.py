"""Prefix fetch in the simulator (issue 51, item 3; sim/fetch.py): a ``kv:fetch`` run
finishes every request, its fetches are the policy's decisions and pin, pull and land as
P/D's pulls do, the pins end, a slow link keeps every prefix where it is, and a fleet
without the variant has no plane."""

from __future__ import annotations

import pytest

from kvroute.replica.model.cost_model import H100_8B
from kvroute.sim.fetch import Fetching
from kvroute.sim.report import router_hashes
from kvroute.sim.simulator import SimConfig, SimRun, split_policy
from kvroute.sim.workloads import TokenSource, make_workload

BS = 64


def fleet(specs, cfg: SimConfig, policy: str) -> SimRun:
    src = TokenSource()
    return SimRun(specs, policy, cfg, src, router_hashes(specs, cfg, src)).run()


def busy_tenants(n: int = 600, speed: float = 3.0):
    """Hot shared prefixes arriving faster than their holders can serve them alone."""
    return make_workload("tenants", n, seed=2, speed=speed)


def test_a_fetch_run_finishes_every_request_and_counts_its_pulls():
    specs = busy_tenants()
    f = fleet(specs, SimConfig(replicas=4, block_size=BS), "kv:fetch")
    assert isinstance(f.pd, Fetching)
    done = [r for r in f.reqs if r is not None and r.done_s is not None]
    assert len(done) == len(specs)
    fs, s = f.pd.fetch_stats, f.pd.stats
    assert fs.routed > 0  # the holders' queues made fetches pay
    assert fs.pinned + fs.missed + fs.gone <= fs.routed  # some may start with all held
    assert s.pulls > 0 and s.pulls <= fs.pinned and not s.failed
    # every pull crossed the link: its bytes over 50 GB/s
    assert s.link_s == pytest.approx(s.pulled_tokens * H100_8B.kv_bytes_per_token / 50e9)
    for rep in f.reps:  # every pin ended (at the holder's next step)
        leases = rep.scheduler.leases
        assert leases is not None
        leases.poll()
        assert len(leases) == 0
        rep.scheduler.kv_cache_manager.block_pool.check_invariants()
    f.index.check_invariants()


def test_a_slow_link_fetches_nothing():
    """At 1 GB/s a token's 128 KiB take longer to move than to compute on an H100."""
    specs = busy_tenants(300)
    f = fleet(specs, SimConfig(replicas=4, block_size=BS, link_bytes_per_s=1e9), "kv:fetch")
    assert isinstance(f.pd, Fetching) and f.pd.fetch_stats.routed == 0


def test_without_the_variant_nothing_fetches():
    specs = busy_tenants(300)
    cfg = SimConfig(replicas=4, block_size=BS)
    plain = fleet(specs, cfg, "kv")
    assert plain.pd is None and plain.policy.fetchable is None  # type: ignore[attr-defined]
    assert all(r.scheduler.leases is None for r in plain.reps)
    assert split_policy("kv:fetch") == ("kv", True)
    with pytest.raises(ValueError, match="only kv policies fetch"):
        fleet(specs[:10], cfg, "least_loaded:fetch")
