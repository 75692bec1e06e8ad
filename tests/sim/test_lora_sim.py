"""LoRA adapters in the simulator: slots never exceed max_loras, every copy into a slot is
counted and costs its bytes over the host link, the replicas report residency as an engine
does, the ``lora`` workload is fixed by its seed, and ``kvroute simulate`` reports adapter
loads and per-adapter TTFT."""

from __future__ import annotations

import json

import pytest

from kvroute.deploy.cli import main
from kvroute.replica.model.cost_model import H100_8B
from kvroute.sim import lora as sim_lora
from kvroute.sim.lora import LoRAConfig, adapter_bytes, projection_shapes
from kvroute.sim.report import router_hashes
from kvroute.sim.simulator import SimConfig, SimRun, split_policy
from kvroute.sim.workloads import TokenSource, assign_adapters, make_workload


def _run(policy: str, max_loras: int, monkeypatch: pytest.MonkeyPatch) -> tuple[SimRun, list]:
    """A short lora workload on 4 replicas; every step's (slots held, adapters running,
    copies) recorded on each replica."""
    seen: list[tuple[int, int, int]] = []
    real = sim_lora.SimLoRA.step

    def step(self, needed, running):  # type: ignore[no-untyped-def]
        copies = real(self, needed, running)
        seen.append((len(self.slots), len(set(needed) | set(running)), copies))
        return copies

    monkeypatch.setattr(sim_lora.SimLoRA, "step", step)
    specs = make_workload("lora", 400, seed=2, speed=2.0, adapters=24)
    cfg = SimConfig(replicas=4, block_size=64, lora=LoRAConfig(max_loras, 6))
    tokens = TokenSource()
    fleet = SimRun(specs, policy, cfg, tokens, router_hashes(specs, cfg, tokens)).run()
    return fleet, seen


@pytest.mark.parametrize("policy", ["kv", "round_robin"])
def test_slots_never_exceed_max_loras_and_loads_are_counted(policy, monkeypatch):
    fleet, seen = _run(policy, 2, monkeypatch)
    done = [r for r in fleet.reqs if r is not None and r.done_s is not None]
    assert len(done) == 400  # every request served, none stuck behind the slot limit
    assert seen and max(s for s, _, _ in seen) <= 2
    assert max(n for _, n, _ in seen) <= 2  # one step mixes at most max_loras adapters
    assert fleet.adapter_loads == sum(c for _, _, c in seen) > 0
    assert fleet.adapter_reads >= len({r.spec.lora_name for r in done}) // 4


def test_a_copy_costs_the_adapters_bytes_over_the_host_link():
    shapes = projection_shapes(H100_8B)
    assert shapes["gate_proj"] == (4096, 14336) and shapes["k_proj"] == (4096, 1024)
    size = adapter_bytes(H100_8B, 16)
    assert size == 16 * 81_920 * 32 * 2  # rank x sum(d_in + d_out) x layers x bf16
    load_s, read_s = LoRAConfig(rank=16).times(H100_8B)
    assert load_s == size / H100_8B.host_bandwidth and read_s == size / H100_8B.disk_bandwidth


def test_replicas_report_residency_and_their_load_times():
    specs = make_workload("lora", 60, seed=1, adapters=8)
    cfg = SimConfig(replicas=2, block_size=64, lora=LoRAConfig(2, 4))
    tokens = TokenSource()
    fleet = SimRun(specs, "kv", cfg, tokens, router_hashes(specs, cfg, tokens)).run()
    for rep in fleet.reps:
        report = rep.load_report()
        assert report.lora_slots == 2 and report.lora_resident == tuple(rep.lora.slots)  # type: ignore[union-attr]
        assert report.lora_free_slots == 2 - len(report.lora_resident)
        c = fleet.policy.load.coefficients(rep.id)
        assert c is not None and c.lora_load_s == LoRAConfig(2, 4).times(H100_8B)[0]


def test_the_lora_workload_is_fixed_by_its_seed():
    a = make_workload("lora", 300, seed=5, adapters=64, adapter_zipf=1.0)
    assert a == make_workload("lora", 300, seed=5, adapters=64, adapter_zipf=1.0)
    assert a != make_workload("lora", 300, seed=6, adapters=64, adapter_zipf=1.0)
    names = [s.lora_name for s in a]
    assert all(n is not None for n in names) and len(set(names)) > 20
    # each adapter's requests share its system prompt (and its tenant's salt)
    by = {}
    for s in a:
        by.setdefault(s.lora_name, set()).add((s.segments[0], s.cache_salt))
    assert all(len(v) == 1 for v in by.values())
    top = max(names.count(n) for n in set(names))
    assert top > 300 / 64 * 4  # Zipf: the hottest adapter far above the mean


def test_existing_workloads_take_adapters_per_tenant():
    specs = make_workload("tenants", 400, seed=3, adapters=16, adapter_zipf=1.2)
    owner = {}
    for s in specs:
        assert owner.setdefault(s.cache_salt, s.lora_name) == s.lora_name  # one per tenant
    assert specs == assign_adapters(make_workload("tenants", 400, seed=3), 16, 1.2, 3)
    chat = make_workload("chat", 200, seed=3, adapters=8)
    assert len({s.lora_name for s in chat}) > 1


def test_kv_lora_blind_is_a_policy_not_a_fleet_variant():
    assert split_policy("kv:lora_blind") == ("kv:lora_blind", True)
    assert split_policy("kv:lora_blind:nohost") == ("kv:lora_blind", False)
    assert split_policy("kv:nohost") == ("kv", False)


def test_simulate_reports_adapter_loads_and_ttft_per_adapter(capsys):
    rc = main(["simulate", "--workload", "lora", "--limit", "200", "--adapters", "12",
               "--policy", "kv,lora_affinity,kv:lora_blind", "--replicas", "3",
               "--max-loras", "2", "--no-bounds", "--json", "--no-progress"])  # fmt: skip
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["lora"]["max_loras"] == 2
    for m in out["policies"].values():
        assert m["adapter_loads_per_1k"] > 0
        per = m["ttft_by_adapter"]
        assert 1 < len(per) <= 12 and sum(d["requests"] for d in per.values()) == 200
        worst = max(per.values(), key=lambda d: d["p99"])
        assert m["adapter_p99_spread"] == pytest.approx(worst["p99"] / m["adapter_p99_median_s"])
        # the wait before a first step is part of the TTFT, never more
        assert m["adapter_worst_queued_p99_s"] == worst["queued_p99"]
        assert worst["queued_p99"] > 0  # 12 adapters on 6 slots: the worst waits for one
        assert all(0.0 <= d["queued_p99"] <= d["p99"] for d in per.values())
