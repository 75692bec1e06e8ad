"""`kvroute simulate`: a small run end to end, its JSON fields, and its errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvroute.deploy.cli import main

TRACE = Path(__file__).resolve().parents[2] / "traces"
TRACE = TRACE / "mooncake_synthetic_trace.jsonl"


def test_simulate_workload_json(capsys):
    rc = main(
        ["simulate", "--workload", "rag", "--limit", "200", "--replicas", "3",
         "--policy", "kv,least_loaded", "--json", "--seed", "1", "--speed", "2"]
    )  # fmt: skip
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"config", "workload", "bounds", "policies"}
    assert out["config"]["replicas"] == 3 and out["config"]["block_size"] == 64
    b = out["bounds"]
    assert 0 < b["pooled_hit_rate"] <= b["ceiling_hit_rate"] < 1
    for name in ("kv", "least_loaded"):
        m = out["policies"][name]
        assert m["completed"] == 200 and len(m["replicas"]) == 3
        assert m["prompt_tokens"] == out["workload"]["prompt_tokens"]
        assert m["hit_tokens"] + m["prefill_tokens"] >= m["prompt_tokens"]
        t = m["ttft_s"]
        assert 0 < t["p50"] <= t["p90"] <= t["p99"] and m["e2e_s"]["p90"] >= t["p90"]
        assert abs(sum(r["work_share"] for r in m["replicas"]) - 1) < 1e-9
        assert m["imbalance"] >= 1


def test_simulate_passes_the_engines_scheduler_knobs(capsys):
    args = ["simulate", "--workload", "tenants", "--limit", "60", "--replicas", "1",
            "--policy", "round_robin", "--json", "--no-bounds", "--speed", "8"]  # fmt: skip
    runs = []
    for extra in ([], ["--long-prefill-token-threshold", "256", "--max-num-partial-prefills", "1"]):
        assert main(args + extra) == 0
        runs.append(json.loads(capsys.readouterr().out))
    assert runs[1]["config"]["long_prefill_token_threshold"] == 256
    assert runs[1]["config"]["max_num_partial_prefills"] == 1
    # the engines chunked prompts differently: the same work, other latencies
    a, b = (r["policies"]["round_robin"] for r in runs)
    assert a["completed"] == b["completed"] == 60
    assert a["ttft_s"] != b["ttft_s"]


@pytest.mark.skipif(not TRACE.is_file(), reason="shared/traces not present")
def test_simulate_trace_table(capsys):
    rc = main(["simulate", "--trace", str(TRACE), "--limit", "150", "--replicas", "2",
               "--policy", "kv,round_robin", "--speed", "4"])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    assert "infinite-cache ceiling" in out and "pooled" in out
    assert out.count("\nkv ") == 1 and "round_robin" in out


def test_simulate_rejects_unknown_policy(capsys):
    assert main(["simulate", "--workload", "chat", "--policy", "kv,nope"]) == 2
    assert "nope" in capsys.readouterr().err


def test_simulate_sweep_reports_goodput_at_the_slo(capsys):
    rc = main(
        ["simulate", "--workload", "rag", "--limit", "150", "--replicas", "2",
         "--policy", "kv,round_robin", "--sweep-speed", "1,50", "--slo-ttft", "1.0",
         "--json", "--no-progress"]
    )  # fmt: skip
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert {(r["policy"], r["speed"]) for r in out["rows"]} == {
        (p, s) for p in ("kv", "round_robin") for s in (1.0, 50.0)
    }
    for row in out["rows"]:
        meets = row["ttft_p90_s"] <= 1.0 and row["itl_p90_s"] <= 0.1
        assert row["meets_slo"] == meets
    slow = {r["policy"]: r for r in out["rows"] if r["speed"] == 1.0}
    for p, g in out["goodput_rps"].items():
        ok = [r["rate_rps"] for r in out["rows"]
              if r["policy"] == p and r["meets_slo"] and r["keeps_up"]]  # fmt: skip
        assert g == max(ok, default=0.0)
        assert slow[p]["meets_slo"] and slow[p]["keeps_up"]  # 150 requests at 1x: easy
    assert main(["simulate", "--workload", "rag", "--sweep-speed", "0,1"]) == 2


def test_simulate_sweep_auto_brackets_each_policys_limit(capsys):
    """``--sweep-speed auto``: each policy's goodput is the rate of a speed that met the SLO,
    and a speed at most 10% above it missed it (both simulated, both in the rows)."""
    rc = main(
        ["simulate", "--workload", "rag", "--limit", "150", "--replicas", "2",
         "--policy", "kv,round_robin", "--sweep-speed", "auto", "--slo-ttft", "1.0",
         "--json", "--no-progress"]
    )  # fmt: skip
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    for p in ("kv", "round_robin"):
        lim = out["limits"][p]
        rows = {r["speed"]: r for r in out["rows"] if r["policy"] == p}
        ok, fail = rows[lim["speed_ok"]], rows[lim["speed_fail"]]
        assert ok["meets_slo"] and ok["keeps_up"]  # sustained: both count (the default)
        assert not (fail["meets_slo"] and fail["keeps_up"])
        assert lim["speed_ok"] < lim["speed_fail"] <= lim["speed_ok"] * 1.1 + 1e-9
        assert out["goodput_rps"][p] == rows[lim["speed_ok"]]["rate_rps"] == lim["rate_ok_rps"]
        for r in rows.values():  # every point tried agrees with the SLO it reports
            assert r["meets_slo"] == (r["ttft_p90_s"] <= 1.0 and r["itl_p90_s"] <= 0.1)


def test_simulate_sweep_auto_says_when_nothing_meets_the_slo(capsys):
    rc = main(
        ["simulate", "--workload", "rag", "--limit", "60", "--replicas", "2",
         "--policy", "round_robin", "--sweep-speed", "auto", "--slo-ttft", "0.000001"]
    )  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    assert "round_robin  0 (missed the SLO down to 0.0156x)" in out


def test_simulate_lora_prints_the_slot_ceiling_and_runs_the_pooled_fleet(capsys):
    args = ["simulate", "--workload", "lora", "--adapters", "24", "--limit", "150", "--seed",
            "3", "--replicas", "2", "--max-loras", "2", "--max-cpu-loras", "4"]  # fmt: skip
    assert main([*args, "--policy", "kv,pooled"]) == 0
    out = capsys.readouterr().out
    assert "LoRA slot ceiling (an estimate" in out and "\npooled " in out
    assert main([*args, "--policy", "pooled", "--sweep-speed", "1,2", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["slot_ceiling"]["slots"] == 4 and 4 < res["slot_ceiling"]["adapters"] <= 24
    assert {r["policy"] for r in res["rows"]} == {"pooled"}
    assert main([*args, "--policy", "pooled:gpu"]) == 2
