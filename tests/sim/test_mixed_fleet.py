"""A mixed fleet (``--profile h100-8b,a100-8b``): each replica runs its own profile's step
times and reports its own coefficients, and the router reads them, so the faster replicas
take more of the work where a load-blind policy splits it evenly."""

from __future__ import annotations

import subprocess
import sys

from kvroute.replica.model.cost_model import A100_8B, H100_8B, CostModel
from kvroute.sim.report import router_hashes, summarize
from kvroute.sim.simulator import SimConfig, SimRun
from kvroute.sim.workloads import TokenSource, make_workload

MIXED = SimConfig(replicas=4, block_size=64, profiles=(H100_8B, A100_8B))


def run(policy: str, workload: str = "chat", speed: float = 8.0, n: int = 400) -> SimRun:
    specs = make_workload(workload, n, seed=5, speed=speed)
    src = TokenSource()
    return SimRun(specs, policy, MIXED, src, router_hashes(specs, MIXED, src)).run()


def test_replicas_alternate_profiles_and_register_their_own_coefficients():
    f = run("round_robin", n=50)
    assert [MIXED.profile(i).name for i in range(4)] == ["h100-8b", "a100-8b"] * 2
    for i, rep in enumerate(f.reps):
        assert rep.cost.p is MIXED.profile(i)
        assert f.policy.load.coefficients(rep.id) == CostModel(MIXED.profile(i)).coefficients()


def test_the_slower_profile_computes_the_same_prompts_slower():
    """round_robin gives both profiles the same kind and number of requests; the A100s'
    first tokens come ~3x later (prefill is compute-bound: 989 against 312 TFLOPS)."""
    f = run("round_robin")
    m = summarize(f, 0.0)
    assert m["by_profile"]["h100-8b"]["routed_share"] == 0.25
    assert m["by_profile"]["a100-8b"]["routed_share"] == 0.25
    ttft: dict[str, list[float]] = {"h100-8b": [], "a100-8b": []}
    for r in f.reqs:
        if r is not None and r.first_s is not None:
            ttft[MIXED.profile(r.replica).name].append(r.first_s - r.spec.arrival_s)
    mean = {k: sum(v) / len(v) for k, v in ttft.items()}
    assert 2.0 < mean["a100-8b"] / mean["h100-8b"] < 4.0, mean


def test_kv_gives_the_faster_replicas_more_work_than_load_blind_routing():
    for workload in ("chat", "agents"):
        kv = summarize(run("kv", workload), 0.0)["by_profile"]
        rr = summarize(run("round_robin", workload), 0.0)["by_profile"]
        kv_ratio = kv["h100-8b"]["work_share"] / max(kv["a100-8b"]["work_share"], 1e-9)
        rr_ratio = rr["h100-8b"]["work_share"] / rr["a100-8b"]["work_share"]
        assert kv_ratio > 1.5, (workload, kv)
        assert 0.8 < rr_ratio < 1.25, (workload, rr)


def test_an_unknown_profile_in_the_list_is_refused():
    out = subprocess.run(
        [sys.executable, "-m", "kvroute.deploy.cli", "simulate", "--workload", "chat",
         "--profile", "h100-8b,b200-8b", "--limit", "10"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    assert "b200-8b" in out.stderr and "a100-8b" in out.stderr
