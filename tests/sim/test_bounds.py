"""The bounds no router can beat: the simulated fleets never do less work than the least
work says, never hit more than the ceiling, and a sustained limit needs a fleet that keeps
up."""

from __future__ import annotations

import json

import pytest

from kvroute.deploy.cli import main
from kvroute.replica.model.cost_model import A100_8B, H100_8B
from kvroute.sim.bounds import ceiling_hits, least_work_s, work_ceiling
from kvroute.sim.report import router_hashes, simulate
from kvroute.sim.simulator import SimConfig
from kvroute.sim.workloads import RequestSpec, TokenSource, make_workload


@pytest.mark.parametrize(
    ("workload", "speed"), [("agents", 1.0), ("rag", 4.0), ("tenants", 16.0), ("chat", 64.0)]
)
def test_no_policy_does_less_work_or_hits_more_than_the_bounds(workload, speed):
    """Light load and deep overload alike: every policy's fleet is busy at least the least
    work's seconds, and hits at most the infinite-cache ceiling."""
    specs = make_workload(workload, 300, seed=2, speed=speed)
    cfg = SimConfig(replicas=4, block_size=64)
    res = simulate(specs, ["kv", "approx_text", "round_robin"], cfg)
    ceiling = res["bounds"]["throughput_ceiling"]
    assert ceiling["least_work_s"] > 0 and 0 < ceiling["hit_rate"] < 1
    for name, m in res["policies"].items():
        assert m["busy_s"] >= ceiling["least_work_s"], name
        assert m["hit_rate"] <= ceiling["hit_rate"] + 1e-12, name


def test_least_work_of_one_request_is_its_roofline_with_full_batches():
    """One request, nothing cached: its prefill and its decode steps' FLOPs and bytes, with
    the weights read once per step of a full batch (here: of its decode over 256 seqs)."""
    p = H100_8B
    n, o = 1000, 513
    w = least_work_s([RequestSpec(0.0, ((1, n),), o)], [0], p)
    d = o - 1
    flops = 2 * p.params * (n + d) + p.attn_flops * (n * (n - 1) / 2 + d * n + d * (d - 1) / 2)
    steps = max(d / p.max_num_seqs, (n + d) / p.max_batched_tokens)
    kv = n + d * n + d * (d + 1) / 2
    nbytes = steps * p.weight_bytes + p.kv_bytes_per_token * kv
    assert w["steps"] == pytest.approx(steps)
    assert w["seconds"] == pytest.approx(steps * p.overhead_s + max(flops / p.peak_flops,
                                                                    nbytes / p.mem_bw))  # fmt: skip
    # a hit takes its tokens out of the prefill, never out of the decode
    hit = least_work_s([RequestSpec(0.0, ((1, n),), o)], [512], p)
    assert hit["compute_s"] < w["compute_s"] and hit["decode_tokens"] == w["decode_tokens"]


def test_ceiling_scales_with_the_fleet_and_is_one_speed_for_every_arrival_rate():
    specs = make_workload("rag", 200, seed=1, speed=1.0)
    fast = make_workload("rag", 200, seed=1, speed=3.0)
    cfg = SimConfig(replicas=4, block_size=64)
    src = TokenSource()
    hashes = router_hashes(specs, cfg, src)
    c1 = work_ceiling(specs, hashes, cfg)
    c3 = work_ceiling(fast, router_hashes(fast, cfg, src), cfg)
    c8 = work_ceiling(specs, hashes, SimConfig(replicas=8, block_size=64))
    assert c8["rate_rps"] == pytest.approx(2 * c1["rate_rps"])
    assert c3["rate_rps"] == pytest.approx(c1["rate_rps"])  # the work does not move...
    assert c3["speed"] == pytest.approx(c1["speed"] / 3)  # ...the arrivals do
    assert c1["hit_rate"] == sum(ceiling_hits(specs, hashes, 64)) / sum(
        s.input_length for s in specs
    )
    # a mixed fleet is bounded by its fastest profile
    mixed = work_ceiling(specs, hashes, SimConfig(replicas=4, block_size=64,
                                                  profiles=(H100_8B, A100_8B)))  # fmt: skip
    assert mixed["rate_rps"] == pytest.approx(c1["rate_rps"])


def test_sustained_goodput_counts_only_rates_the_fleet_keeps_up_with(capsys):
    """Far above the ceiling a short run can still meet a loose SLO while its backlog drains
    after the last arrival; by default (``--sustained``) that rate does not count."""
    args = ["simulate", "--workload", "chat", "--limit", "200", "--replicas", "2",
            "--policy", "kv", "--sweep-speed", "1,400", "--slo-ttft", "1000",
            "--slo-itl", "10", "--json", "--no-progress"]  # fmt: skip
    assert main([*args, "--no-sustained"]) == 0
    loose = json.loads(capsys.readouterr().out)
    assert main(args) == 0  # --sustained is the default
    kept = json.loads(capsys.readouterr().out)
    rows = {r["speed"]: r for r in loose["rows"]}
    assert rows[1.0]["keeps_up"] and rows[1.0]["utilization"] < 1
    assert rows[400.0]["meets_slo"] and not rows[400.0]["keeps_up"]
    assert loose["goodput_rps"]["kv"] == rows[400.0]["rate_rps"]
    assert kept["goodput_rps"]["kv"] == rows[1.0]["rate_rps"]
    assert kept["slo"]["sustained"] and not loose["slo"]["sustained"]
    # what the fleet kept up with is below the ceiling (a consequence of the bound: the
    # replicas' least work sums to at least the workload's); the drained run was above it
    ceiling = kept["ceiling"]["rate_rps"]
    assert kept["goodput_rps"]["kv"] <= ceiling < loose["goodput_rps"]["kv"]
