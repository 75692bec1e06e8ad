"""``kvroute bench`` against real parts: a local Ray, two ``tiny`` replica actors and the real
front door under uvicorn (:func:`tests.router.served.serve`), driven through the CLI's own
``main`` as a user would run it.

Why real parts: what the load generator must get right lives in the server's answers -- the
SSE framing, the usage chunk's cached tokens, the replica header, a 401 for a bad key.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvroute.deploy.cli import main
from kvroute.loadgen.report import load_result
from kvroute.replica.serve.actor import start_replica

from ..ray_session import local_ray
from ..router.served import KEYS, Served, serve

CONFIG = {"model": "tiny", "block_size": 16, "num_blocks": 160}
TINY = ["--vocab-size", "256", "--no-progress"]
KEY = ["--api-key", "key-a"]  # the fleet asks for one of KEYS


@pytest.fixture(scope="module")
def fleet() -> Iterator[Served]:
    with local_ray() as started:
        actors = [start_replica(f"r{i}", CONFIG, num_cpus=0.5, torch_threads=1) for i in range(2)]
        started.extend(actors)
        with serve(actors) as served:
            yield served


def bench(fleet: Served, tmp_path: Path, name: str, *args: str) -> dict[str, Any]:
    out = tmp_path / f"{name}.json"
    argv = ["bench", "--url", fleet.url + "/v1", "--json", str(out), "--label", name, *TINY]
    assert main([*argv, *args]) == 0
    return load_result(out)


def test_tenants_workload_completes_and_reports_the_fleet(
    fleet: Served, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Tenants' system prompts at 5% length (51-410 tokens): a popular tenant repeats a
    # prefix of several 16-token blocks; one key per tenant salt.
    args = ["--workload", "tenants", "--max-requests", "30", "--length-scale", "0.05"]
    args += ["--max-tokens", "4", "--concurrency", "4", "--api-key", "key-a"]
    res = bench(fleet, tmp_path, "tenants", *args, "--api-key", "key-b")
    s, records = res["summary"], res["records"]
    assert s["requests"] == s["ok"] == 30 and s["errors"] == {}
    assert all(r.ok and r.output_tokens == 4 for r in records)  # ignore_eos: exact
    assert sum(s["per_replica"].values()) == 30 and set(s["per_replica"]) <= set(fleet.actors)
    assert all(r.replica in fleet.actors for r in records)
    prompt = sum(r.prompt_tokens for r in records)
    cached = sum(r.cached_tokens for r in records)
    assert cached > 0 and s["hit_rate"] == pytest.approx(cached / prompt)
    assert all(r.cached_tokens % 16 == 0 and r.cached_tokens < r.prompt_tokens for r in records)
    # kvroute's timing comment: the replica's own TTFT, within the client's.
    assert all(0 < r.replica_ttft_s <= r.router_ttft_s <= r.ttft_s for r in records)
    assert res["config"]["model"] == "tiny"  # asked of GET /v1/models
    assert res["config"]["api_keys"] == 2 and "key-a" not in json.dumps(res["config"])
    table = capsys.readouterr().out
    assert "| metric | tenants |" in table and "requests on r0" in table


def test_trace_as_text_at_a_rate_then_report_two_runs(fleet: Served, tmp_path: Path) -> None:
    # A Mooncake trace: every request starts with block 1, half continue with block 2.
    trace = tmp_path / "t.jsonl"
    lines = [
        {"timestamp": 100 * i, "input_length": 700 if i % 2 else 520, "output_length": 3,
         "hash_ids": [1, 2] if i % 2 else [1, 100 + i]}
        for i in range(12)
    ]  # fmt: skip
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    common = ["--trace", str(trace), "--length-scale", "0.25", "--model", "tiny", *KEY]
    text = bench(fleet, tmp_path, "text", *common, "--prompt-format", "text", "--rate", "40")
    tokens = bench(fleet, tmp_path, "tokens", *common, "--speed", "10")
    for res in (text, tokens):
        assert res["summary"]["ok"] == 12 and res["summary"]["hit_rate"] > 0
        # tiny's tokenizer maps the text back 1:1: the server counts the tokens sent.
        want = [175 if i % 2 else 130 for i in range(12)]
        assert [r.prompt_tokens for r in res["records"]] == want
    assert 0.1 <= tokens["records"][-1].start_s < 0.6  # its 1.1 s of trace at speed 10
    plot = tmp_path / "cmp.png"
    out = _report([str(tmp_path / "text.json"), str(tmp_path / "tokens.json")], plot)
    assert "| metric | text | tokens |" in out and plot.stat().st_size > 1000


def _report(files: list[str], plot: Path) -> str:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["bench", "report", *files, "--plot", str(plot)]) == 0
    return buf.getvalue()


def test_bad_api_key_is_counted_not_fatal(fleet: Served, tmp_path: Path) -> None:
    assert "nope" not in KEYS
    args = ["--workload", "chat", "--max-requests", "6", "--concurrency", "3"]
    res = bench(fleet, tmp_path, "bad", *args, "--model", "tiny", "--api-key", "nope")
    assert res["summary"]["errors"] == {"http_401": 6} and res["summary"]["ok"] == 0
    assert res["summary"]["per_replica"] == {}


def test_max_requests_and_duration_bound_the_run(fleet: Served, tmp_path: Path) -> None:
    small = ["--length-scale", "0.02", "--model", "tiny", *KEY]
    args = ["--workload", "rag", "--max-requests", "5", "--concurrency", "2", "--max-tokens", "2"]
    res = bench(fleet, tmp_path, "five", *args, *small)
    assert res["summary"]["requests"] == res["summary"]["ok"] == 5
    # Long answers at 20/s for 1 s: sending stops at 1 s, the rest is cancelled 0.3 s later.
    t0 = time.monotonic()
    args = ["--workload", "chat", "--rate", "20", "--duration", "1", "--grace", "0.3"]
    res = bench(fleet, tmp_path, "timed", *args, *small, "--max-tokens", "400")
    took = time.monotonic() - t0
    s = res["summary"]
    assert 3 <= s["requests"] < 1000 and took < 6
    assert set(s["errors"]) <= {"cancelled"} and s["errors"].get("cancelled", 0) >= 1
    assert max(r.start_s for r in res["records"]) < 1.0
    # A cancelled request keeps what was measured before (its replica, once answered).
    assert set(s["per_replica"]) <= set(fleet.actors)
    assert s["wall_s"] < 1.0 + 0.3 + 1.0


def test_defaults_fit_the_server_they_ask(
    fleet: Served, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The model card says what bench must fit: tiny's vocabulary, the cache-capped context.
    card = httpx.get(fleet.url + "/v1/models", headers={"Authorization": "Bearer key-a"})
    (model,) = card.json()["data"]
    assert model["id"] == "tiny" and 256 < model["vocab_size"] < 300
    context = model["max_model_len"]
    assert context == 160 * 16  # num_blocks x block_size caps the model's 8192 positions
    # `kvroute bench` with nothing but the URL and a key: the quick chat run, every request
    # inside the vocabulary and the context, so nothing fails.
    out = tmp_path / "quick.json"
    argv = ["bench", "--url", fleet.url + "/v1", "--api-key", "key-a", "--json", str(out)]
    assert main(argv) == 0
    res = load_result(out)
    s, records = res["summary"], res["records"]
    assert s["requests"] == s["ok"] == 20 and s["errors"] == {}
    assert all(r.prompt_tokens + r.output_tokens <= context for r in records)
    assert all(r.output_tokens <= 32 for r in records)
    c = res["config"]
    assert (c["vocab_size"], c["max_model_len"]) == (model["vocab_size"], context)
    assert c["concurrency"] == 4
    err = capsys.readouterr().err
    assert "no --trace or --workload: the chat workload, 20 requests" in err
    assert f"cut to fit the context of {context} tokens" in err  # chat's history outgrows it
    assert "bench: 20/20 done, 0 errors" in err  # kvroute's own progress line


def test_a_server_refusing_everything_stops_the_run_within_seconds(
    fleet: Served, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A vocabulary the server does not have: every request is a 400. 1000 requests at 20/s
    # would take 50 s; bench stops after 10 failures in a row with the server's message.
    out = tmp_path / "refused.json"
    argv = ["bench", "--url", fleet.url + "/v1", *KEY, "--json", str(out), "--no-progress"]
    argv += ["--workload", "chat", "--rate", "20", "--vocab-size", "100000"]
    t0 = time.monotonic()
    assert main(argv) == 1
    took = time.monotonic() - t0
    assert took < 5, took
    s = load_result(out)["summary"]
    assert s["ok"] == 0 and s["errors"].get("http_400", 0) >= 10
    assert s["requests"] < 30
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if "stopped after" in x)
    assert "stopped after 10 failed requests in a row" in line
    assert "the last: HTTP 400: prompt: token ids must be ints in [0, 261)" in line
