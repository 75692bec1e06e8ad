"""Adapter files as a hostile tenant or a sick mount leaves them (issue 50): read once,
checked always, and never read on the engine's thread.

What must hold: an adapter whose weights were rewritten at another rank after it was
registered fails its own requests with a reason naming it and what changed, and is refused
at once afterwards, while the engine serves the base model and other adapters exactly as
before; a read or a registration that hangs is abandoned at its deadline, counted, and
starves neither other adapters' reads nor the steps; a FIFO where a file should be is
refused at once instead of blocking.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import shutil
import threading
import time
from pathlib import Path

import pytest

from kvroute.replica import LLM, SamplingParams
from kvroute.replica.engine.async_engine import AsyncLLMEngine
from kvroute.replica.engine.llm_engine import EngineConfig, LLMEngine
from kvroute.replica.model import lora_store as lora_store_module
from kvroute.replica.model.lora_adapter import CONFIG_FILE, WEIGHTS_FILE, LoRAError, inspect_adapter
from kvroute.replica.model.lora_reads import AdapterReads, ReadTimeoutError
from kvroute.replica.model.lora_store import LoRAStore

from ...lora_adapters import make_adapter

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
QV = {"lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
PROMPT = [5, 6, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Two adapters of rank 8, and the victim's weights at rank 4 (the same names)."""
    root = tmp_path_factory.mktemp("reads")
    return {
        "victim": make_adapter(root / "victim", 1, r=8, **QV),
        "other": make_adapter(root / "other", 2, r=8, lora_alpha=8, target_modules=["o_proj"]),
        "rank4": make_adapter(root / "rank4", 3, r=4, **QV),
    }


def _run(engine: LLMEngine, jobs: dict[str, str | None], deltas: bool = False) -> dict:  # type: ignore[type-arg]
    """Each request to its end; every step must return (none may raise)."""
    for rid, adapter in jobs.items():
        engine.add_request(rid, PROMPT, GREEDY, lora_name=adapter, deltas=deltas)
    done = {}
    for _ in range(500):
        done.update({o.request_id: o for o in engine.step() if o.finished})
        if not engine.has_unfinished_requests():
            return done
    raise AssertionError(f"unfinished after 500 steps: {set(jobs) - set(done)}")


def test_an_adapter_rewritten_at_another_rank_fails_its_requests_alone(
    made: dict[str, str], tmp_path: Path
) -> None:
    victim = Path(shutil.copytree(made["victim"], tmp_path / "victim"))
    llm = LLM("tiny", dtype="float32", num_blocks=128, max_loras=2,
              lora_modules={"other": made["other"], "victim": str(victim)})  # fmt: skip
    engine = llm.llm_engine
    before = _run(engine, {"base": None, "other": "other"})  # the victim not read yet
    original = (victim / WEIGHTS_FILE).read_bytes()
    shutil.copy(Path(made["rank4"]) / WEIGHTS_FILE, victim / WEIGHTS_FILE)  # same names, r=4

    after = _run(engine, {"bad": "victim", "base2": None, "other2": "other"})
    bad = after["bad"].outputs[0]
    assert bad.finish_reason == "error" and bad.token_ids == []
    assert re.search(r"'victim' changed on disk .* has shape \[(4, 256|\d+, 4)\], registered "
                     r"\[(8, 256|\d+, 8)\]", bad.error), bad.error  # fmt: skip
    assert str(victim) not in bad.error  # the server's folder is not the client's to read
    for rid, then in (("base2", "base"), ("other2", "other")):  # untouched, token for token
        assert after[rid].outputs[0].token_ids == before[then].outputs[0].token_ids
        assert after[rid].outputs[0].finish_reason == "length"
    # Unavailable here from now on: refused when it comes, with the same reason.
    with pytest.raises(ValueError, match="model: LoRA adapter 'victim' changed on disk"):
        engine.add_request("again", PROMPT, GREEDY, lora_name="victim")
    assert engine.lora.stats.read_failures == 1  # type: ignore[union-attr]
    assert engine.scheduler.load_report().lora_read_failures == 1  # what /metrics shows

    # Put right and registered again: it serves, and a rewrite met over the data plane is
    # the client's refusal ("invalid": a 400 naming `model`), not an engine fault.
    (victim / WEIGHTS_FILE).write_bytes(original)
    engine.add_lora("victim", str(victim))
    assert _run(engine, {"fixed": "victim"})["fixed"].outputs[0].finish_reason == "length"
    engine.remove_lora("victim")
    engine.add_lora("victim", str(victim))  # unloaded and loaded again: read anew
    shutil.copy(Path(made["rank4"]) / WEIGHTS_FILE, victim / WEIGHTS_FILE)
    delta = _run(engine, {"wire": "victim"}, deltas=True)["wire"]
    assert delta.failure == "invalid" and delta.error.startswith("model: LoRA adapter 'victim'")


def test_a_bad_adapter_in_memory_fails_its_requests_not_the_step(
    made: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last check, before a slot is written: an adapter whose weights got into host
    memory unchecked (simulated: the reader's checks bypassed) fails its own requests,
    and the step goes on for the others (the slot copy would have raised on it)."""
    llm = LLM("tiny", dtype="float32", num_blocks=128, max_loras=2,
              lora_modules={"victim": made["victim"]})  # fmt: skip
    real_load, real_check, real_activate = (
        lora_store_module.load_adapter,
        LoRAStore._check,
        LoRAStore._activate,
    )
    stepping: list[bool] = []

    def unchecked_load(name, spec, dtype):  # type: ignore[no-untyped-def]
        rank4 = dataclasses.replace(spec, path=made["rank4"], shapes={})  # r=4 as if r=8
        return real_load(name, rank4, dtype)

    def check_on_the_step_only(self, adapter):  # type: ignore[no-untyped-def]
        if stepping:
            real_check(self, adapter)

    def activate(self, key, needed):  # type: ignore[no-untyped-def]
        stepping.append(True)
        try:
            return real_activate(self, key, needed)
        finally:
            stepping.pop()

    monkeypatch.setattr(lora_store_module, "load_adapter", unchecked_load)
    monkeypatch.setattr(LoRAStore, "_check", check_on_the_step_only)
    monkeypatch.setattr(LoRAStore, "_activate", activate)
    done = _run(llm.llm_engine, {"bad": "victim", "base": None})
    bad = done["bad"].outputs[0]
    assert bad.finish_reason == "error" and "the slots take [256, 8] x [8, " in bad.error
    assert done["base"].outputs[0].finish_reason == "length"
    assert llm.llm_engine.lora.unavailable("victim", made["victim"]) is not None  # type: ignore[union-attr]


def test_a_hung_read_is_abandoned_at_its_deadline_and_starves_no_other(
    made: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM("tiny", dtype="float32", num_blocks=128, max_loras=2,
              lora_modules={"other": made["other"], "victim": made["victim"]})  # fmt: skip
    engine = llm.llm_engine
    store = engine.lora
    assert store is not None
    store.reads.timeout_s, store.reads.workers = 1.0, 1  # one reader: a hang would block all
    release = threading.Event()
    real = lora_store_module.load_adapter

    def hung(name, spec, dtype):  # type: ignore[no-untyped-def]
        if name == "victim":
            release.wait(60)  # a mount that does not answer
        return real(name, spec, dtype)

    monkeypatch.setattr(lora_store_module, "load_adapter", hung)
    try:
        t0 = time.monotonic()
        done = _run(engine, {"stuck": "victim", "base": None, "other": "other"})
        took = time.monotonic() - t0
        stuck = done["stuck"].outputs[0]
        assert stuck.finish_reason == "error" and "no answer within 1 s" in stuck.error
        assert done["other"].outputs[0].finish_reason == "length"  # read after it, in time
        assert done["base"].outputs[0].finish_reason == "length"
        assert took < 30, took  # the deadline, not the hang
        assert store.reads.hung == 1 and store.reads.timed_out == 1
        assert engine.scheduler.load_report().lora_reads_hung == 1
    finally:
        release.set()
    deadline = time.monotonic() + 10
    while store.reads.hung and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.reads.hung == 0  # the abandoned thread ended and was counted out


def test_reads_refused_once_too_many_hang() -> None:
    reads = AdapterReads(timeout_s=0.2, workers=1, max_hung=1)
    release = threading.Event()
    first, queued = (reads.submit(f"hung {i}", lambda: release.wait(30)) for i in range(2))
    try:
        with pytest.raises(ReadTimeoutError, match=r"no answer within 0\.2 s"):
            first.result(10)
        assert reads.hung == 1 and reads.timed_out == 1
        for fut in (queued, reads.submit("next", lambda: 1)):  # queued, then new: refused
            with pytest.raises(ReadTimeoutError, match="1 earlier adapter reads are still hung"):
                fut.result(1)
        assert reads.hung == 1  # no thread more
    finally:
        release.set()
    deadline = time.monotonic() + 10
    while reads.hung and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reads.submit("after", lambda: 7).result(5) == 7


def test_a_fifo_for_a_file_is_refused_at_once(made: dict[str, str], tmp_path: Path) -> None:
    """A reader of a FIFO waits for a writer forever: it must be refused, not opened."""
    for fifo_name in (CONFIG_FILE, WEIGHTS_FILE):
        folder = Path(shutil.copytree(made["victim"], tmp_path / fifo_name))
        (folder / fifo_name).unlink()
        os.mkfifo(folder / fifo_name)
        got: list[BaseException] = []

        def inspect(folder: Path = folder, got: list[BaseException] = got) -> None:
            try:
                inspect_adapter(folder, {"q_proj": (64, 64), "v_proj": (64, 32)}, 4, 16)
            except BaseException as exc:
                got.append(exc)

        thread = threading.Thread(target=inspect, daemon=True)
        thread.start()
        thread.join(5)
        if thread.is_alive():  # unblock the old code's reader before failing
            fd = os.open(folder / fifo_name, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
            raise AssertionError(f"{fifo_name}: a FIFO blocked the check")
        assert isinstance(got[0], LoRAError) and "not a regular file" in str(got[0])


async def test_a_hung_registration_blocks_no_request(
    made: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder whose check never answers (a hung mount): the load fails at the deadline,
    and requests run meanwhile -- the check is not on the engine's thread."""
    engine = AsyncLLMEngine.from_config(
        EngineConfig(model="tiny", dtype="float32", num_blocks=64, enable_lora=True)
    )
    assert engine.llm_engine.lora is not None
    engine.llm_engine.lora.reads.timeout_s = 3.0
    release = threading.Event()
    real = lora_store_module.inspect_adapter

    def hung(path, *args):  # type: ignore[no-untyped-def]
        if "victim" in str(path):
            release.wait(60)
        return real(path, *args)

    monkeypatch.setattr(lora_store_module, "inspect_adapter", hung)
    try:
        t0 = time.monotonic()
        load = asyncio.ensure_future(engine.add_lora("victim", made["victim"]))
        await asyncio.sleep(0.2)  # the load is under way
        async for out in engine.generate(PROMPT, GREEDY):
            last = out
        served = time.monotonic() - t0
        assert last.finished and served < 2.5, served  # before the deadline, not after it
        assert not load.done()
        with pytest.raises(LoRAError, match="no answer within 3 s"):
            await asyncio.wait_for(load, 20)
        assert time.monotonic() - t0 < 10
        assert await engine.add_lora("other", made["other"]) == made["other"]  # others load
        assert await engine.list_loras() == {"other": made["other"]}
    finally:
        release.set()
        engine.shutdown()
