"""A LoRA engine tells routers where its adapters are and what a load costs it.

A ``tiny`` engine with 2 device slots serves 3 random PEFT adapters; its load report, as
the data plane encodes and a front door decodes it, names the adapters in slots, the free
slots, those running requests hold and those in host memory (residency, not recent use),
and its cost coefficients carry the adapter load it timed at start.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from kvroute.events import dataplane_wire as dp
from kvroute.events.load import LoadReport
from kvroute.replica import LLM, SamplingParams

from ..model.test_lora import ADAPTERS, _make_adapter

peft = pytest.importorskip("peft")

NAMES = ["qv8", "all16", "mlp4rs"]


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters3")
    return {n: str(_make_adapter(root / n, i, **ADAPTERS[n])) for i, n in enumerate(NAMES, 1)}


def _report(llm: LLM) -> LoadReport:
    """The engine's report as a front door gets it: msgpack over the data plane."""
    return dp.decode_load(dp.encoder.encode(llm.llm_engine.scheduler.load_report()))


def test_residency_in_a_real_engines_load_report(three: dict[str, str]) -> None:
    llm = LLM("tiny", dtype="float32", num_blocks=128, max_loras=2, max_cpu_loras=3,
              lora_modules=three)  # fmt: skip
    engine = llm.llm_engine
    coef = engine.cost_coefficients()
    assert coef.lora_load_s > 0 and coef.lora_read_s > 0  # timed at start, one adapter each

    start = _report(llm)  # the start's measurement gave its adapter up again
    assert start.lora_slots == 2 and start.lora_free_slots == 2
    assert start.lora_resident == () and start.lora_running == () and start.lora_host == ()

    params = SamplingParams(temperature=0.0, max_tokens=4)
    for name in NAMES:  # one after another: the last two end in the slots
        llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9], "lora_name": name}], params)
        assert name in _report(llm).lora_resident
    done = _report(llm)
    assert set(done.lora_resident) == {NAMES[1], NAMES[2]} and done.lora_free_slots == 0
    assert set(done.lora_host) == set(NAMES)  # the host LRU keeps all three
    assert done.lora_running == ()  # resident, yet nothing runs: residency is not activity

    # While a request of one adapter runs, its slot is reported held.
    engine.add_request("held", [5, 6, 7], SamplingParams(max_tokens=50), lora_name=NAMES[0])
    engine.step()
    mid = _report(llm)
    assert NAMES[0] in mid.lora_resident and mid.lora_running == (NAMES[0],)
    while engine.has_unfinished_requests():
        engine.step()


def test_old_reports_still_decode() -> None:
    """A report without the LoRA fields (a vLLM engine, an older kvroute) decodes to none."""
    old = {"num_waiting": 1, "num_running": 2, "num_decoding": 2, "queued_prefill_tokens": 3,
           "decode_context_tokens": 40, "free_blocks": 7, "total_blocks": 9}  # fmt: skip
    report = dp.decode_load(msgspec.msgpack.encode(old))
    assert report.lora_slots == 0 and report.lora_resident == () and report.lora_host == ()


def test_no_lora_engine_reports_no_slots(tmp_path: Path) -> None:
    llm = LLM("tiny", dtype="float32", num_blocks=64)
    report = _report(llm)
    assert report.lora_slots == 0 and report.lora_resident == ()
    assert llm.llm_engine.cost_coefficients().lora_load_s == 0.0
