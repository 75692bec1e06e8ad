"""``POST /v1/responses`` through the real front door with the official ``openai`` client,
on the random-weight ``tiny`` model: text, function tools (forced, and ``auto`` read by the
hermes parser), ``text.format``, input items carrying calls and their outputs, streamed
typed events, and the refusals that name their field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from kvroute.replica.serve.actor import start_replica
from kvroute.router.api.agents.tools import ToolConfig

from ....ray_session import local_ray
from ...served import MODEL, Served, assert_clean_error, serve

CONFIG = {"model": MODEL, "block_size": 16, "num_blocks": 256}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Lyon"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "name": "get_weather", "description": "Forecast", "parameters": WEATHER},
    {
        "type": "function",
        "name": "get_time",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
]
LONG = {"ignore_eos": True}


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with local_ray() as started:
        actor = start_replica("ra0", CONFIG, num_cpus=0.5, torch_threads=1)
        started.append(actor)
        with serve([actor], tools=ToolConfig("hermes", auto=True)) as s:
            yield s


def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key="key-a", max_retries=0, timeout=120)


def events(stream: Any) -> list[Any]:
    got = list(stream)
    assert [e.sequence_number for e in got] == list(range(len(got)))
    assert got[0].type == "response.created" and got[1].type == "response.in_progress"
    assert got[-1].type in ("response.completed", "response.incomplete")
    return got


def test_text_whole_and_streamed(served: Served) -> None:
    c = client(served)
    kw: dict[str, Any] = {
        "model": MODEL, "input": "Tell me a story", "max_output_tokens": 12,
        "instructions": "Be brief.", "temperature": 0, "extra_body": LONG,
    }  # fmt: skip
    whole = c.responses.create(**kw)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    [item] = whole.output
    assert item.type == "message" and item.role == "assistant"
    assert whole.usage.output_tokens == 12 and whole.usage.input_tokens > 10
    assert whole.usage.input_tokens_details.cached_tokens >= 0
    got = events(c.responses.create(**kw, stream=True))
    kinds = [e.type for e in got]
    assert kinds[2:5] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.delta"
    ]  # fmt: skip
    assert kinds[-4:-1] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done"
    ]  # fmt: skip
    text = "".join(e.delta for e in got if e.type == "response.output_text.delta")
    assert text == whole.output_text == got[-1].response.output_text
    assert got[-1].type == "response.incomplete"
    # The second request's prompt was the first's: its full blocks were hits.
    assert got[-1].response.usage.input_tokens_details.cached_tokens >= 16


def test_forced_function_calls_validate_streamed_and_not(served: Served) -> None:
    c = client(served)
    kw: dict[str, Any] = {"model": MODEL, "input": "Weather in Lyon?", "tools": TOOLS,
                          "max_output_tokens": 200, "temperature": 1}  # fmt: skip
    for seed in range(2):
        whole = c.responses.create(**kw, tool_choice="required", extra_body={"seed": seed})
        assert whole.status == "completed"
        calls = [o for o in whole.output if o.type == "function_call"]
        assert calls and all(o.call_id and o.name in ("get_weather", "get_time") for o in calls)
        for o in calls:
            if o.name == "get_weather":
                jsonschema.validate(json.loads(o.arguments), WEATHER)
        got = events(
            c.responses.create(**kw, tool_choice="required", extra_body={"seed": seed}, stream=True)
        )
        done = [e for e in got if e.type == "response.function_call_arguments.done"]
        assert [(e.name, json.loads(e.arguments)) for e in done] == [
            (o.name, json.loads(o.arguments)) for o in calls
        ]
        for e in done:
            pieces = [x.delta for x in got if x.type == "response.function_call_arguments.delta"
                      and x.item_id == e.item_id]  # fmt: skip
            assert "".join(pieces) == e.arguments
    named = c.responses.create(**kw, tool_choice={"type": "function", "name": "get_weather"})
    [call] = [o for o in named.output if o.type == "function_call"]
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)


def test_auto_reads_a_hermes_call(served: Served) -> None:
    call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    regex = "".join("\\" + ch if ch in "\\{}[]().*+?|^$" else ch for ch in "Sure. " + call)
    got = client(served).responses.create(
        model=MODEL, input="time?", tools=TOOLS, max_output_tokens=100,
        extra_body={"structured_outputs": {"regex": regex}},
    )  # fmt: skip
    assert [o.type for o in got.output] == ["message", "function_call"]
    assert got.output_text == "Sure. "
    assert (got.output[1].name, got.output[1].arguments) == ("get_time", "{}")


def test_text_format_json_schema(served: Served) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    got = client(served).responses.create(
        model=MODEL, input="ok?", max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "v", "schema": schema, "strict": True}},
        extra_body={"structured_outputs": {"disable_any_whitespace": True}},
    )  # fmt: skip
    assert got.status == "completed" and got.text.format.type == "json_schema"
    jsonschema.validate(json.loads(got.output_text), schema)


def test_input_items_carry_calls_and_their_outputs(served: Served) -> None:
    """A second turn sends the first's function call and its output as items."""
    c = client(served)
    kw: dict[str, Any] = {"model": MODEL, "tools": TOOLS, "max_output_tokens": 60}
    first = c.responses.create(**kw, input="Weather?", tool_choice="required", temperature=0)
    calls = [o for o in first.output if o.type == "function_call"]
    items: list[Any] = [{"role": "user", "content": "Weather?"}]
    items += [{"type": "function_call", "call_id": o.call_id, "name": o.name,
               "arguments": o.arguments} for o in calls]  # fmt: skip
    items += [{"type": "function_call_output", "call_id": o.call_id, "output": "sunny"}
              for o in calls]  # fmt: skip
    second = c.responses.create(**kw, input=items, tool_choice="none", temperature=0)
    assert second.output[0].type == "message"
    assert second.usage.input_tokens > first.usage.input_tokens
    assert (
        second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 16 * 16 - 16
    )


BAD: list[tuple[dict[str, Any], str]] = [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools.0.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"max_output_tokens": 100_000}, "max_output_tokens"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input.0.arguments"),
    ({"input": []}, "input"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "param"), BAD, ids=[b[1] for b in BAD])
def test_refusals_name_the_responses_field(
    served: Served, extra: dict[str, Any], param: str
) -> None:
    r = httpx.post(
        served.url + "/v1/responses",
        json={"model": MODEL, "input": "hi", **extra},
        headers={"authorization": "Bearer key-a"},
        timeout=60,
    )
    assert assert_clean_error(r, 400)["param"] == param


def test_keys_apply(served: Served) -> None:
    r = httpx.post(served.url + "/v1/responses", json={"input": "hi"}, timeout=60)
    assert r.status_code == 401
