"""Structured outputs in the engine: whatever the (random-weight) model prefers, a constrained
request's text is valid for its schema, regex, choice or grammar, and its batch mates are
untouched. The tiny model left alone emits bytes that parse as none of these."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest

from kvroute.events.replica_api import Resume, SamplingParams, StructuredOutputs
from kvroute.replica import LLM
from kvroute.replica.engine.llm_engine import EngineConfig, LLMEngine

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "enum": ["yes", "no", "maybe"]},
        "sure": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["answer", "sure", "tags"],
    "additionalProperties": False,
}
PROMPTS = ["Answer in JSON: ", "The quick brown fox", "0123456789"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", num_blocks=256)


def run(llm: LLM, so: StructuredOutputs, temperature: float, **kw) -> list[tuple[str, str]]:
    kw.setdefault("seed", 5)
    params = SamplingParams(max_tokens=160, temperature=temperature, structured_outputs=so, **kw)
    outs = llm.generate(PROMPTS, params)
    return [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(llm: LLM, temperature: float) -> None:
    so = StructuredOutputs(json=json.dumps(SCHEMA), disable_any_whitespace=True)
    for text, finish in run(llm, so, temperature):
        assert finish == "stop", text
        # strict=False: xgrammar's JSON strings (vLLM's too) admit raw control characters,
        # which Python's strict parser refuses; everything else is the schema's.
        jsonschema.validate(json.loads(text, strict=False), SCHEMA)


def test_json_object_regex_choice_and_grammar(llm: LLM) -> None:
    obj = StructuredOutputs(json_object=True, disable_any_whitespace=True)
    # Any object: a random model's keys may run to max_tokens, but each output opens an
    # object, and every one that ended is one.
    objects = run(llm, obj, 0.0) + run(llm, obj, 1.0)
    assert all(text.startswith("{") for text, _ in objects)
    ended = [text for text, finish in objects if finish == "stop"]
    assert ended and all(isinstance(json.loads(t, strict=False), dict) for t in ended)
    for text, finish in run(llm, StructuredOutputs(regex=r"[A-Z]{2}-[0-9]{3}"), 1.0):
        assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", text) and finish == "stop"
    colours = ["red", "green", "blue", "vert émeraude", '🟦 "bleu"\n']  # beyond ASCII, escapes
    seen = set()
    for seed in range(4):
        for text, _ in run(llm, StructuredOutputs(choice=colours), 1.0, seed=seed):
            assert text in colours
            seen.add(text)
    assert len(seen) > 1
    for text, _ in run(llm, StructuredOutputs(choice=colours[-1:]), 0.0):  # the odd one, alone
        assert text == colours[-1]
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    for text, finish in run(llm, StructuredOutputs(grammar=grammar), 0.0):
        assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", text) and finish == "stop"


def test_only_the_constrained_row_is_masked(llm: LLM) -> None:
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = llm.generate(PROMPTS[1], free)[0].outputs[0].token_ids
    so = StructuredOutputs(regex=r"[0-9]{1,12}")
    both = llm.generate(
        [PROMPTS[1], PROMPTS[1]],
        [free, SamplingParams(max_tokens=12, temperature=0.0, structured_outputs=so)],
    )
    assert both[0].outputs[0].token_ids == alone
    assert re.fullmatch(r"[0-9]{1,12}", both[1].outputs[0].text)
    assert not re.fullmatch(r"[0-9]{1,12}", both[0].outputs[0].text)  # left alone, it is not


def test_a_resumed_request_goes_on_where_its_grammar_stood() -> None:
    """A failover hands the tokens made so far to another replica: its matcher replays them
    and the rest is what one replica would have made (greedy)."""
    so = StructuredOutputs(json=json.dumps(SCHEMA), disable_any_whitespace=True)
    params = SamplingParams(max_tokens=160, temperature=0.0, structured_outputs=so)
    whole = LLM("tiny", num_blocks=256).generate(PROMPTS[0], params)[0].outputs[0]
    made = list(whole.token_ids[:7])
    engine = LLMEngine(EngineConfig(model="tiny", num_blocks=256))
    engine.add_request("r", PROMPTS[0], params, resume=Resume(output_token_ids=made))
    rest: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            rest.extend(out.delta_token_ids)
    assert made + rest == list(whole.token_ids)


def test_a_constraint_that_does_not_compile_is_refused_with_nothing_queued() -> None:
    engine = LLMEngine(EngineConfig(model="tiny", num_blocks=64))
    for so in (StructuredOutputs(regex="(ab"), StructuredOutputs(json='{"type": "nonsense"}')):
        with pytest.raises(ValueError, match="structured_outputs") as err:
            engine.add_request("r", "x", SamplingParams(structured_outputs=so))
        assert ".cc" not in str(err.value) and "\n" not in str(err.value)
    assert not engine.has_unfinished_requests()
    bad = StructuredOutputs(regex="(ab")  # its refusal is kept: asked again, not recompiled
    assert engine.structured.is_compiled(bad)
    with pytest.raises(ValueError, match="parenthesis"):
        engine.add_request("again", "x", SamplingParams(structured_outputs=bad))
    sim = LLMEngine(EngineConfig(model="sim:h100-8b", num_blocks=64))
    with pytest.raises(ValueError, match="cost model"):
        sim.add_request("r", "x", SamplingParams(structured_outputs=StructuredOutputs(regex="a")))


class _Sink:
    """Takes a request's outputs and says nobody listens (the request is aborted anyway)."""

    deltas = False

    def deliver(self, request_id: str, item: object) -> bool:
        return True

    def flush(self) -> None:
        pass


def test_a_new_constraint_compiles_off_the_engine_thread_and_an_abort_meanwhile_holds() -> None:
    """Through the threaded engine: a constrained request compiles on a worker thread, then
    runs; one aborted at once ends up on no queue of the engine either way."""
    import asyncio

    from kvroute.replica.engine.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model="tiny", num_blocks=64)))
    so = StructuredOutputs(regex=r"[0-9]{3}-[a-z]{2}")
    params = SamplingParams(max_tokens=20, temperature=0.0, structured_outputs=so)

    async def go() -> str:
        text = ""
        async for out in engine.generate("a prompt", params):
            text = out.outputs[0].text
        return text

    try:
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", asyncio.run(go()))
        assert engine.llm_engine.structured.is_compiled(so)
        other = StructuredOutputs(regex=r"[a-z]{400}")  # not compiled yet: goes to the worker
        long = SamplingParams(max_tokens=400, temperature=0.0, structured_outputs=other)
        engine.submit("doomed", "x", long, _Sink())
        engine.abort("doomed")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (
            engine.num_compiling or engine.llm_engine.has_unfinished_requests()
        ):
            time.sleep(0.05)
        assert not engine.num_compiling and not engine.llm_engine.has_unfinished_requests()
    finally:
        engine.shutdown()
