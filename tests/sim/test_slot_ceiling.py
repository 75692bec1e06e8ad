"""The LoRA slot ceiling and the pooled fleet: the estimate has its closed form, never
claims more busy slots than a simulated fleet holds, and the pooled fleet is the fleet's
resources in one replica whose steps last as long as an average replica's."""

from __future__ import annotations

import math

import pytest

from kvroute.replica.model.cost_model import A100_8B, H100_8B, CostModel
from kvroute.sim.bounds import least_step_s, slot_ceiling
from kvroute.sim.lora import LoRAConfig
from kvroute.sim.report import router_hashes, simulate
from kvroute.sim.simulator import POOLED, SimConfig, SimRun
from kvroute.sim.workloads import RequestSpec, TokenSource, make_workload


def _equal_adapters(n: int, per: int, out_len: int, span: float) -> list[RequestSpec]:
    """``n`` adapters of ``per`` requests each, evenly spread over ``span`` seconds."""
    total = n * per
    return [
        RequestSpec(span * i / (total - 1), ((i, 100),), out_len, None, f"a{i % n}")
        for i in range(total)
    ]


def test_slot_ceiling_is_the_closed_form_for_equal_adapters():
    """n equal adapters keep n * (1 - exp(-s * L)) slots busy at speed s (L: one
    adapter's hold per second at 1x), so the slots S fill at s = -ln(1 - S/n) / L."""
    n, per, out_len, span = 10, 30, 200, 60.0
    specs = _equal_adapters(n, per, out_len, span)
    cfg = SimConfig(replicas=2, lora=LoRAConfig(max_loras=4))
    c = slot_ceiling(specs, cfg)
    assert c is not None
    load = per * out_len * least_step_s(H100_8B) / span
    speed = -math.log(1 - 8 / n) / load
    assert c["speed"] == pytest.approx(speed, rel=1e-9)
    assert c["rate_rps"] == pytest.approx(speed * len(specs) / span, rel=1e-9)
    assert c["busy_slots_at_1x"] == pytest.approx(n * -math.expm1(-load))
    assert (c["slots"], c["adapters"]) == (8, n)
    # the fleet's slots count, not how they are split; more slots, a higher ceiling; as
    # many slots as adapters: none at any rate
    wider = slot_ceiling(specs, SimConfig(replicas=4, lora=LoRAConfig(max_loras=2)))
    assert wider is not None and wider["speed"] == pytest.approx(speed)
    nine = slot_ceiling(specs, SimConfig(replicas=3, lora=LoRAConfig(max_loras=3)))
    assert nine is not None and nine["speed"] > speed
    full = slot_ceiling(specs, SimConfig(replicas=5, lora=LoRAConfig(max_loras=2)))
    assert full is not None and full["speed"] is None and full["rate_rps"] is None


def test_slot_ceiling_counts_only_adapters_and_the_fastest_step():
    specs = _equal_adapters(10, 30, 200, 60.0)
    base = [RequestSpec(s.arrival_s + 0.01, s.segments, 500) for s in specs]  # no adapter
    cfg = SimConfig(replicas=2, lora=LoRAConfig(max_loras=4))
    both = sorted(specs + base, key=lambda s: s.arrival_s)
    alone, mixed = slot_ceiling(specs, cfg), slot_ceiling(both, cfg)
    assert alone is not None and mixed is not None
    assert mixed["busy_slots_at_1x"] == pytest.approx(alone["busy_slots_at_1x"], rel=1e-3)
    assert slot_ceiling(base, cfg) is None
    assert slot_ceiling(specs, SimConfig(replicas=2)) is None  # no slots
    # a mixed fleet's holds are priced at its fastest replica's least step
    fleet = SimConfig(replicas=2, profiles=(A100_8B, H100_8B), lora=LoRAConfig(max_loras=4))
    mixed_fleet = slot_ceiling(specs, fleet)
    assert mixed_fleet is not None and mixed_fleet["least_step_s"] == least_step_s(H100_8B)


def test_a_simulated_fleet_holds_at_least_the_slots_the_estimate_says():
    """The estimate's optimistic side, checked against the simulator at a light load where
    slots do not bind: each (adapter, replica) with a request between its first token and
    its end holds a slot; their time average is no less than the estimate's busy slots,
    and not far above it (the holds run at a light batch's step, near the least)."""
    specs = make_workload("lora", 600, seed=3, speed=0.5, adapters=24)
    cfg = SimConfig(replicas=4, block_size=64, lora=LoRAConfig(max_loras=4, max_cpu_loras=8))
    tokens = TokenSource()
    fleet = SimRun(specs, "kv", cfg, tokens, router_hashes(specs, cfg, tokens)).run()
    done = [r for r in fleet.reqs if r is not None and r.done_s is not None]
    assert len(done) == len(specs)
    spans: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for r in done:
        spans.setdefault((r.spec.lora_name, r.replica), []).append((r.first_s, r.done_s))
    held = 0.0
    for intervals in spans.values():  # the union of each pair's intervals
        end = -math.inf
        for a, b in sorted(intervals):
            held += max(0.0, b - max(a, end))
            end = max(end, b)
    span = specs[-1].arrival_s - specs[0].arrival_s
    c = slot_ceiling(specs, cfg)
    assert c is not None
    estimate = c["busy_slots_at_1x"]  # (o steps held; the sim's first token to end: o - 1)
    measured = held / span
    print(f"held {measured:.2f} slots on average, estimate {estimate:.2f}")
    assert estimate <= measured <= 1.6 * estimate, (measured, estimate)


def test_the_pooled_fleet_sums_resources_and_keeps_an_average_step():
    cfg = SimConfig(replicas=4, profiles=(H100_8B, A100_8B), host_kv_multiple=2.0,
                    lora=LoRAConfig(max_loras=4, max_cpu_loras=16))  # fmt: skip
    pooled = cfg.pooled()
    p = pooled.profile(0)
    assert pooled.replicas == 1 and pooled.total_blocks == cfg.total_blocks
    assert pooled.host_blocks(0) == sum(cfg.host_blocks(i) for i in range(4))
    assert p.peak_flops == pytest.approx(2 * H100_8B.peak_flops + 2 * A100_8B.peak_flops)
    assert p.mem_bw == pytest.approx(2 * H100_8B.mem_bw + 2 * A100_8B.mem_bw)
    assert pooled.lora == LoRAConfig(max_loras=16, max_cpu_loras=64)
    assert (p.max_num_seqs, p.max_batched_tokens) == (4 * 256, 4 * 8192)
    assert cfg.fair_share and not pooled.fair_share  # one engine, first come first served
    # four equal replicas' decode steps, merged: as long as one of them, not shorter
    same = SimConfig(replicas=4).pooled().profile(0)
    one = CostModel(H100_8B).step_time(16, 16 * 2000, 16 * 2000)
    merged = CostModel(same).step_time(64, 64 * 2000, 64 * 2000)
    assert merged == pytest.approx(one)


def test_pooled_runs_beside_the_policies():
    specs = make_workload("lora", 200, seed=1, speed=1.0, adapters=12)
    cfg = SimConfig(replicas=4, block_size=64, lora=LoRAConfig(max_loras=2, max_cpu_loras=6))
    res = simulate(specs, [POOLED, "kv"], cfg)
    assert set(res["policies"]) == {POOLED, "kv"}
    pooled = res["policies"][POOLED]
    assert pooled["completed"] == 200 and len(pooled["replicas"]) == 1
    assert pooled["hit_rate"] >= res["policies"]["kv"]["hit_rate"]
    assert res["bounds"]["slot_ceiling"]["slots"] == 8
    tokens = TokenSource()
    fleet = SimRun(specs[:20], "round_robin", cfg.pooled(), tokens,
                   router_hashes(specs[:20], cfg, tokens)).run()  # fmt: skip
    assert all(r.tenant is None and r.spec.cache_salt for r in fleet.reqs if r is not None)


def test_pooled_nohost_pools_the_fleet_without_its_host_tier():
    specs = make_workload("chat", 150, seed=4, speed=2.0)
    cfg = SimConfig(replicas=4, block_size=64, blocks_per_replica=40, host_kv_multiple=4.0)
    res = simulate(specs, [POOLED, f"{POOLED}:nohost"], cfg, with_bounds=False)
    tiered, device = res["policies"][POOLED], res["policies"][f"{POOLED}:nohost"]
    assert tiered["hit_rate_by_tier"]["CPU"] > 0 == device["hit_rate_by_tier"]["CPU"]
    assert tiered["hit_rate"] > device["hit_rate"]
