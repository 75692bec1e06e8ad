"""The tool plan without a server: markers a replica's detokenizer drops put back, and how
each mode reads a whole and a streamed answer (tests/router/api/agents/test_tool_calls.py runs
them live)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from kvroute.router.api.agents.tool_parsers import ParsedCall, make_parser
from kvroute.router.api.agents.tools import ToolConfig, ToolStream, plan_tools, special_markers
from kvroute.router.api.responses import Collected

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "g"}}]  # fmt: skip
CALL = '[{"name": "f", "arguments": {"a": 1}}]'


class MistralTokenizer:
    """A tokenizer whose ``[TOOL_CALLS]`` (id 5) is a special token."""

    all_special_tokens = ["</s>", "[TOOL_CALLS]"]

    def get_vocab(self) -> dict[str, int]:
        return {"</s>": 2, "[TOOL_CALLS]": 5, "a": 10}


def body(**kw: Any) -> Any:
    fields = {"tools": TOOLS, "tool_choice": None, "parallel_tool_calls": None}
    return SimpleNamespace(**{**fields, **kw})


def mistral_plan(**kw: Any) -> Any:
    tok = MistralTokenizer()
    markers = special_markers(tok, make_parser("mistral", tok))
    assert markers == {5: "[TOOL_CALLS]"}
    return plan_tools(body(**kw), ToolConfig("mistral", auto=True), tok, markers)


def test_a_special_marker_the_replica_dropped_is_put_back() -> None:
    plan = mistral_plan()
    # The replica's deltas: text without the marker; the marker's id in the second.
    deltas = [("Sure.", [10]), ("", [5]), (CALL, [11, 12])]
    got = Collected()
    for text, ids in deltas:
        got.parts.append(text)
        got.sizes.append(len(ids))
        got.ids.extend(ids)
    content, calls = plan.read(got.tool_text(plan))
    assert (content, calls) == ("Sure.", [ParsedCall("f", '{"a": 1}')])
    stream = ToolStream(plan)
    out = [d for text, ids in deltas for d in stream.feed(text, ids)]
    more, finish = stream.finish("stop")
    assert out == [{"content": "Sure."}] and finish == "tool_calls"
    assert [d["tool_calls"][0]["function"] for d in more] == [
        {"name": "f", "arguments": ""},
        {"arguments": '{"a": 1}'},
    ]
    assert more[0]["tool_calls"][0]["id"].isalnum() and len(more[0]["tool_calls"][0]["id"]) == 9
    # Without the marker's id the same text holds no call: the ids are what found it.
    assert plan.read("Sure." + CALL) == ("Sure." + CALL, [])


def test_no_markers_for_a_tokenizer_without_special_ones() -> None:
    class Plain:
        all_special_tokens: list[str] = []

        def get_vocab(self) -> dict[str, int]:
            return {"<tool_call>": 3}

    assert special_markers(Plain(), make_parser("hermes")) == {}


def test_required_reads_the_constrained_array_and_parallel_false_keeps_one() -> None:
    cfg = ToolConfig("hermes", auto=True)
    plan = plan_tools(body(tool_choice="required"), cfg)
    assert plan is not None and plan.mode == "required"
    schema = json.loads(plan.structured().json)  # type: ignore[union-attr]
    assert schema["minItems"] == 1 and "maxItems" not in schema
    text = '[{"name":"f","parameters":{"a":1}},{"name":"g","parameters":{}}]'
    content, calls = plan.read(text)
    assert content is None and [c.name for c in calls] == ["f", "g"]
    assert plan.finish_reason("stop", calls) == "tool_calls"
    assert plan.finish_reason("length", []) == "length"
    assert plan.read('[{"name":"f","para') == ('[{"name":"f","para', [])  # cut short
    single = plan_tools(body(tool_choice="required", parallel_tool_calls=False), cfg)
    assert json.loads(single.structured().json)["maxItems"] == 1  # type: ignore[union-attr]
    auto = plan_tools(body(parallel_tool_calls=False), cfg)
    two = "<tool_call>" + '{"name": "f", "arguments": {}}' + "</tool_call>"
    assert auto is not None and len(auto.read(two + two)[1]) == 1


def test_a_named_functions_arguments_stream_as_they_come() -> None:
    plan = plan_tools(body(tool_choice={"type": "function", "function": {"name": "g"}}),
                      ToolConfig())  # fmt: skip
    assert plan is not None and json.loads(plan.structured().json) == {  # type: ignore[union-attr]
        "type": "object",
        "properties": {},
    }
    stream = ToolStream(plan)
    first = stream.feed('{"x"')
    assert first[0]["tool_calls"][0]["function"] == {"name": "g", "arguments": ""}
    assert first[1]["tool_calls"][0] == {"index": 0, "function": {"arguments": '{"x"'}}
    assert stream.feed(": 1}") == [
        {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}
    ]
    assert stream.finish("stop") == ([], "stop")


def test_required_calls_stream_as_their_items_close_and_equal_the_whole() -> None:
    plan = plan_tools(body(tool_choice="required"), ToolConfig())
    assert plan is not None
    text = '[{"name":"f","parameters":{"a":[1,{"b":"}"}]}},{"name":"g","parameters":{}}]'
    whole = plan.read(text)
    assert [c.name for c in whole[1]] == ["f", "g"]
    for size in range(1, len(text) + 1):
        stream = ToolStream(plan)
        sent_at = []  # characters fed when each call's head went out
        deltas = []
        for at in range(0, len(text), size):
            got = stream.feed(text[at : at + size])
            sent_at += [at + size] * sum("id" in d["tool_calls"][0] for d in got)
            deltas += got
        more, finish = stream.finish("stop")
        deltas += more
        calls: dict[int, list[str]] = {}
        for d in deltas:
            piece = d["tool_calls"][0]
            fn = piece["function"]
            name, args = calls.setdefault(piece["index"], ["", ""])
            calls[piece["index"]] = [name + fn.get("name", ""), args + fn.get("arguments", "")]
        assert [ParsedCall(*calls[i]) for i in sorted(calls)] == whole[1], size
        assert finish == "tool_calls"
        first_end = text.index("},{") + 2  # the first item closes here
        assert sent_at[0] <= first_end + size, (size, sent_at)
    cut = text[: text.index(',{"name":"g"') + 5]  # cut by max_tokens inside the second
    assert plan.read(cut) == (None, whole[1][:1])
    assert plan.read('[{"name":"f","par') == ('[{"name":"f","par', [])


def test_schemas_too_large_for_a_constraint_are_a_400_naming_tools() -> None:
    from kvroute.events.bounds import MAX_STRUCTURED_CHARS
    from kvroute.router.api.errors import APIError

    big = {"type": "object", "description": "x" * MAX_STRUCTURED_CHARS}
    tools = [{"type": "function", "function": {"name": "f", "parameters": big}}]
    named = {"type": "function", "function": {"name": "f"}}
    for choice, param in (("required", "tools"), (named, "tool_choice")):
        plan = plan_tools(body(tools=tools, tool_choice=choice), ToolConfig())
        assert plan is not None
        with pytest.raises(APIError) as info:
            plan.structured()
        assert (info.value.status, info.value.param) == (400, param)
