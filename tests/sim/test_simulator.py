"""Fleet simulator: the event path keeps the index equal to the engines' truth through loss,
restarts and removal; runs are deterministic; the decode fast path is exact; the engine
model conserves work."""

from __future__ import annotations

import json
from array import array
from pathlib import Path

import pytest

from kvroute.sim.report import router_hashes, simulate, to_json
from kvroute.sim.simulator import Fault, SimConfig, SimRun
from kvroute.sim.traces import (
    load_mooncake,
    prompt_tokens,
    specs_from_trace,
)
from kvroute.sim.workloads import TokenSource, make_workload

TRACES = Path(__file__).resolve().parents[2] / "traces"


def fleet(specs, policy: str, cfg: SimConfig) -> SimRun:
    src = TokenSource()
    return SimRun(specs, policy, cfg, src, router_hashes(specs, cfg, src)).run()


def strip_wall(result: dict) -> dict:
    out = to_json(result)
    for m in out["policies"].values():
        m.pop("wall_s")
    return out


def test_index_equals_engine_truth_after_churn_loss_restarts_and_removal():
    specs = make_workload("agents", 300, seed=3, speed=4.0)
    cfg = SimConfig(
        replicas=4,
        blocks_per_replica=900,  # small: constant eviction churn
        block_size=64,
        event_delay_s=0.02,
        event_loss=0.2,
        faults=(
            Fault(10.0, 1, "restart"),
            Fault(15.0, 2, "down"),
            Fault(30.0, 2, "up"),
            Fault(40.0, 0, "restart"),
        ),
    )
    f = fleet(specs, "kv", cfg)
    assert f.lost_batches > 10
    removed = sum(rep.kv.block_pool.num_blocks for rep in f.reps)  # pools exist
    assert removed and f.preemptions >= 0
    held = 0
    for rep in f.reps:
        truth = rep.kv.block_pool.cached_hash_counts()
        assert f.index.counts(rep.id) == truth, rep.id
        held += len(truth)
    assert held > 0
    f.index.check_invariants()
    done = [r for r in f.reqs if r is not None and r.done_s is not None]
    assert len(done) == len(specs) - f.rejected


def test_lost_batches_without_recovery_would_be_caught():
    """The check above can fail: drop the batches of the last few seconds for good and the
    index disagrees with the engines."""
    specs = make_workload("chat", 150, seed=1, speed=4.0)
    cfg = SimConfig(replicas=2, blocks_per_replica=300, block_size=64)
    f = SimRun(specs, "kv", cfg, (src := TokenSource()), router_hashes(specs, cfg, src))
    publish = f._publish
    dropped = []
    last_arrival = specs[-1].arrival_s

    def lossy(rep, events=None, run_steps=0):
        events = rep.take_events() if events is None else events
        if events and f.now > last_arrival:
            dropped.append(events)
            return
        publish(rep, events, run_steps)

    f._publish = lossy  # type: ignore[method-assign]
    f.run()
    assert dropped
    assert any(f.index.counts(r.id) != r.kv.block_pool.cached_hash_counts() for r in f.reps)


def test_same_seed_same_numbers():
    specs = make_workload("tenants", 120, seed=2, speed=3.0)
    cfg = SimConfig(replicas=3, block_size=64, blocks_per_replica=2000, event_loss=0.1, seed=9)
    a = strip_wall(simulate(specs, ["kv", "random"], cfg))
    b = strip_wall(simulate(specs, ["kv", "random"], cfg))
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    cfg.seed = 10
    c = strip_wall(simulate(specs, ["random"], cfg, with_bounds=False))
    assert c["policies"]["random"] != a["policies"]["random"]


@pytest.mark.parametrize("blocks", [4000, 260])
def test_fast_decode_path_is_exact(blocks):
    specs = make_workload("chat", 200, seed=4, speed=3.0)
    # Load reports and lost batches included: a run publishes what its steps would, when
    # they would, so the policy sees the same figures and routes alike.
    cfg = SimConfig(replicas=2, block_size=64, blocks_per_replica=blocks, event_loss=0.1)
    fast = fleet(specs, "kv", cfg)
    cfg.fast_decode = False
    slow = fleet(specs, "kv", cfg)
    assert fast.decode_tokens == slow.decode_tokens and fast.preemptions == slow.preemptions
    assert fast.lost_batches == slow.lost_batches > 0
    assert sum(rep.num_runs for rep in fast.reps) > 100  # the fast path was taken
    capacity = blocks * cfg.block_size
    for a, b in zip(fast.reqs, slow.reqs, strict=True):
        assert a is not None and b is not None
        assert a.hit == b.hit and a.replica == b.replica
        # A prompt the whole cache cannot hold is refused in both modes, never served.
        too_long = a.prompt_len + 1 > capacity
        assert (a.first_s is None) == (b.first_s is None) == too_long
        if not too_long:
            assert a.first_s == pytest.approx(b.first_s, rel=1e-9)
            assert a.done_s == pytest.approx(b.done_s, rel=1e-9)


def test_work_is_conserved_and_preemption_recovers():
    specs = make_workload("rag", 150, seed=5, speed=5.0)
    roomy = fleet(specs, "round_robin", SimConfig(replicas=2, block_size=64))
    assert roomy.preemptions == 0
    assert roomy.decode_tokens == sum(s.output_length - 1 for s in specs)
    prompt = sum(s.input_length for s in specs)
    hits = sum(r.hit for r in roomy.reqs)  # type: ignore[misc]
    assert sum(rep.prefill_tokens for rep in roomy.reps) == prompt - hits
    tight = fleet(
        specs, "round_robin", SimConfig(replicas=2, block_size=64, blocks_per_replica=150)
    )
    assert tight.preemptions > 0
    assert all(r is not None and r.done_s is not None for r in tight.reqs)


def test_kv_beats_round_robin_on_hits_with_shared_prefixes():
    specs = make_workload("tenants", 400, seed=6, speed=2.0)
    cfg = SimConfig(replicas=4, block_size=64, blocks_per_replica=1500)
    res = simulate(specs, ["kv", "round_robin"], cfg)
    kv, rr = res["policies"]["kv"], res["policies"]["round_robin"]
    assert kv["hit_rate"] > rr["hit_rate"] + 0.05
    assert res["bounds"]["ceiling_hit_rate"] >= res["bounds"]["pooled_hit_rate"] >= kv["hit_rate"]


@pytest.mark.skipif(not TRACES.is_dir(), reason="shared/traces not present")
def test_trace_specs_replay_the_trace_tokens():
    reqs = load_mooncake(TRACES / "mooncake_conversation_trace.jsonl", limit=30)
    specs = specs_from_trace(reqs)
    src = TokenSource()
    for req, spec in zip(sorted(reqs, key=lambda r: r.arrival_s), specs, strict=True):
        toks = array("I")
        toks.frombytes(src.prompt_bytes(spec))
        assert toks.tolist() == prompt_tokens(req, src.vocab_size)


def test_simulated_replicas_report_load_through_the_routers_load_tracker():
    """The policy reads simulated replicas the way the front door reads live ones: their
    coefficients registered from their info, their LoadReports fed to LoadTracker.report."""
    from kvroute.events.load import LoadReport

    specs = make_workload("rag", 120, seed=3, speed=4.0)
    cfg = SimConfig(replicas=3, block_size=64, blocks_per_replica=3000)
    src = TokenSource()
    f = SimRun(specs, "kv", cfg, src, router_hashes(specs, cfg, src))
    seen: list[tuple[str, LoadReport]] = []
    report = f.policy.load.report
    f.policy.load.report = lambda r, rep, now: (seen.append((r, rep)), report(r, rep, now))[1]
    f.run()
    assert {r for r, _ in seen} == {rep.id for rep in f.reps}
    assert all(isinstance(rep, LoadReport) and rep.total_blocks == 3000 for _, rep in seen)
    assert any(rep.num_decoding and rep.decode_context_tokens for _, rep in seen)
    assert any(rep.queued_prefill_tokens for _, rep in seen)
    assert f.policy.load.coefficients("replica-0") == f.reps[0].cost.coefficients()
