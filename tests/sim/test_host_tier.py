"""The simulator's host KV tier: evicted device blocks live on in a host LRU, a prefix found
there is loaded (device blocks, cached under their hashes) instead of recomputed, the copies
cost host-link time, the index's lower tier equals the replicas' host tiers through loss and
restarts, and `kvroute simulate` reports hits by tier with a device-only fleet beside."""

from __future__ import annotations

import json

import pytest

from kvroute.deploy.cli import main
from kvroute.events import BlockHasher, BlockRemoved, BlockStored, to_external
from kvroute.events.replica_api import SamplingParams
from kvroute.replica.core.request import Request
from kvroute.replica.model.cost_model import H100_8B, CostModel
from kvroute.sim.host_tier import TieredKVCacheManager
from kvroute.sim.report import router_hashes, simulate
from kvroute.sim.simulator import Fault, SimConfig, SimRun, split_policy
from kvroute.sim.workloads import TokenSource, make_workload

BS = 4


def request(rid: str, base: int, n: int = 17) -> Request:
    return Request(rid, [base + i for i in range(n)], SamplingParams(max_tokens=1))


def admit(kv: TieredKVCacheManager, req: Request) -> int:
    """What the scheduler does for a new request: lookup, allocate, count; its hit."""
    blocks, hit = kv.get_computed_blocks(req, count=False)
    assert kv.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None
    kv.count_lookup(req, hit)
    if req.num_cached_tokens < 0:
        req.num_cached_tokens = hit
    return hit


def test_an_evicted_prefix_is_copied_to_the_host_and_loaded_back():
    kv = TieredKVCacheManager(5, BlockHasher(block_size=BS), host_blocks=8)
    a = request("a", 0)
    assert admit(kv, a) == 0
    kv.free(a)
    kv.take_events()
    b = request("b", 1000)
    admit(kv, b)  # takes every device block: a's four cached blocks are evicted
    kv.free(b)
    ev = kv.take_events()
    copied = [e for e in ev if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert len(copied) == 4 and all(e.block_size == 0 and not e.token_ids for e in copied)
    assert kv.take_copies() == (0, 4)
    a2 = request("a2", 0)
    assert kv.peek_cached_tokens(a2) == 16  # the load report's view: nothing to prefill
    assert admit(kv, a2) == 16  # all four found on the host: loaded, not recomputed
    assert a2.host_hit == 16 and kv.host_hit_tokens == 16
    loaded, out = kv.take_copies()
    assert loaded == 4 and out == 4  # room for them: b's four cached blocks went to the host
    ev = kv.take_events()
    # the loaded blocks are the device's again, under their hashes, chained to block 0
    dev = [e for e in ev if isinstance(e, BlockStored) and e.medium == "GPU"]
    assert dev[0].block_hashes == [to_external(h, "bytes") for h in kv.block_hashes(a2)[:4]]
    assert dev[0].parent_block_hash is None
    assert kv.block_pool.get_cached_block(kv.block_hashes(a2)[0]) is not None
    kv.block_pool.check_invariants()


def test_the_host_lru_drops_its_oldest_and_says_so():
    kv = TieredKVCacheManager(5, BlockHasher(block_size=BS), host_blocks=4)
    for i in range(3):  # each request's blocks evict the previous one's
        r = request(f"r{i}", 1000 * i)
        admit(kv, r)
        kv.free(r)
    ev = kv.take_events()
    dropped = [h for e in ev if isinstance(e, BlockRemoved) and e.medium == "CPU"
               for h in e.block_hashes]  # fmt: skip
    assert len(kv.host.lru) == 4 and len(dropped) == 4  # r0's four, for r1's
    assert not kv.host.lru.keys() & set(dropped)


def test_no_host_block_is_loaded_into_a_full_device():
    kv = TieredKVCacheManager(5, BlockHasher(block_size=BS), host_blocks=8)
    a = request("a", 0)
    admit(kv, a)
    kv.free(a)
    b = request("b", 1000)
    admit(kv, b)  # b holds every block now, a's are on the host only
    a2 = request("a2", 0)
    blocks, hit = kv.get_computed_blocks(a2, count=False)
    assert hit == 16 and not blocks
    assert kv.allocate_slots(a2, 1, hit, blocks) is None  # short of device blocks
    assert kv.take_copies() == (0, 4) and len(kv.host.lru) == 4  # nothing changed


def test_a_copy_costs_link_time_and_bounds_the_step_from_below():
    cost = CostModel(H100_8B)
    t = cost.transfer_s("CPU", 100_000, 20_000)
    assert t == pytest.approx(100_000 * H100_8B.kv_bytes_per_token / H100_8B.host_bandwidth)
    assert cost.step_time(10, 45, 10, t) == pytest.approx(H100_8B.overhead_s + t)
    assert cost.step_time(8192, 8192 * 4096, 8192, t) == cost.step_time(8192, 8192 * 4096, 8192)
    c = cost.coefficients(("CPU",))
    assert c.tier_bytes_per_s == {"CPU": H100_8B.host_bandwidth}
    assert c.tier_load_s_per_token("CPU") == pytest.approx(131_072 / 48e9)


def small(host: float | None = 4.0, **kw) -> SimConfig:
    """Devices that hold a few agent tasks: their contexts outgrow them."""
    return SimConfig(replicas=2, blocks_per_replica=450, block_size=64, host_kv_multiple=host,
                     **kw)  # fmt: skip


def run(specs, policy: str, cfg: SimConfig) -> SimRun:
    src = TokenSource()
    return SimRun(specs, policy, cfg, src, router_hashes(specs, cfg, src)).run()


def test_a_host_tier_serves_what_the_device_evicted_and_the_index_knows_where():
    specs = make_workload("agents", 240, seed=5, speed=0.5)
    tiered, device = run(specs, "kv", small()), run(specs, "kv:nohost", small())
    host_hit = sum(r.host_hit for r in tiered.reqs if r is not None)
    hit = {f: sum(r.hit or 0 for r in f.reqs if r is not None) for f in (tiered, device)}
    assert host_hit > 0 and hit[tiered] > hit[device]
    assert sum(r.prefill_tokens for r in tiered.reps) < sum(r.prefill_tokens for r in device.reps)
    assert all(r.transfer_s > 0 and r.loaded_tokens > 0 for r in tiered.reps)
    assert device.index.tiers() == [] and not any(r.host_blocks for r in device.reps)
    for rep in tiered.reps:  # every event delivered: each tier as the replica holds it
        assert tiered.index.counts(rep.id) == rep.kv.block_pool.cached_hash_counts()
        host = {to_external(h, "bytes"): 1 for h in rep.kv.host.lru}
        assert tiered.index.counts(rep.id, "CPU") == host and host
    tiered.index.check_invariants()


def test_lost_batches_and_restarts_leave_the_index_equal_to_every_tier():
    specs = make_workload("agents", 240, seed=6, speed=1.0)
    cfg = small(
        event_loss=0.2,
        event_delay_s=0.02,
        faults=(Fault(8.0, 0, "restart"), Fault(12.0, 1, "down"), Fault(20.0, 1, "up")),
    )
    f = run(specs, "kv", cfg)  # fmt: skip
    assert f.lost_batches > 5
    for rep in f.reps:
        assert f.index.counts(rep.id) == rep.kv.block_pool.cached_hash_counts()
        host = {to_external(h, "bytes"): 1 for h in rep.kv.host.lru}
        assert f.index.counts(rep.id, "CPU") == host
    f.index.check_invariants()


def test_split_policy_names():
    assert split_policy("kv") == ("kv", True)
    assert split_policy("kv_tier_blind:nohost") == ("kv_tier_blind", False)
    with pytest.raises(ValueError):
        split_policy("kv:gpu")


def test_the_report_gives_hits_by_tier_and_the_tiered_pooled_bound():
    specs = make_workload("agents", 120, seed=7, speed=0.5)
    out = simulate(specs, ["kv", "kv:nohost"], small())
    b = out["bounds"]
    assert b["pooled_hit_rate"] <= b["pooled_tiered_hit_rate"] <= b["ceiling_hit_rate"]
    assert out["config"]["host_blocks_per_replica"] == 1800
    kv, nohost = out["policies"]["kv"], out["policies"]["kv:nohost"]
    t = kv["hit_rate_by_tier"]
    assert t["GPU"] + t["CPU"] == pytest.approx(kv["hit_rate"]) and t["CPU"] > 0
    assert nohost["hit_rate_by_tier"]["CPU"] == 0 and nohost["host_loaded_tokens"] == 0


def test_simulate_cli_tier_flags(capsys):
    args = ["simulate", "--workload", "agents", "--limit", "80", "--replicas", "2",
            "--blocks-per-replica", "450", "--host-kv-blocks", "900",
            "--host-bandwidth-gbps", "12", "--policy", "kv,kv_tier_blind,kv:nohost",
            "--json", "--no-bounds"]  # fmt: skip
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["host_blocks_per_replica"] == 900
    assert out["config"]["host_bandwidth_bytes_s"] == [12e9]
    assert set(out["policies"]) == {"kv", "kv_tier_blind", "kv:nohost"}
    assert main([*args[:-4], "--policy", "kv:gpu", "--json"]) == 2
    with pytest.raises(SystemExit):  # one of the two sizes, not both
        main([*args[:-4], "--host-kv-multiple", "2", "--json"])
