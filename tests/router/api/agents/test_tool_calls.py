"""Tool calling in /v1/chat/completions through the real front door, with the official
``openai`` client, on the random-weight ``tiny`` model.

A random model writes no call by itself, so each way of getting one is forced: ``required``
and a named function by the tools' schemas (the server's own constraint), ``auto`` by a
``structured_outputs`` regex that makes the model write a Hermes call, which the server's
``hermes`` parser must then read. ``tiny``'s template cannot show tools, so kvroute's
ChatML tool template renders them (router/api/agents/tool_template.py)."""

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
        "city": {"type": "string", "enum": ["Paris", "Lyon", "Nice"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days", "metric"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
HERMES_CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon", "days": 2, '
    '"metric": true}}\n</tool_call>'
)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with local_ray() as started:
        actor = start_replica("tc0", CONFIG, num_cpus=0.5, torch_threads=1)
        started.append(actor)
        with serve([actor], tools=ToolConfig("hermes", auto=True)) as s:
            yield s


def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key="key-a", max_retries=0, timeout=120)


def check_calls(calls: Any, names: set[str]) -> list[tuple[str, dict[str, Any]]]:
    """Every call has an id, a tool's name and arguments that validate against its schema."""
    out = []
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in names
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


def streamed(stream: Any) -> tuple[str, list[dict[str, Any]], str | None]:
    """A streamed answer put back together as a client does: the content, the calls (by
    ``index``: id and name from their first piece, arguments concatenated), the finish."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        content += delta.content or ""
        for piece in delta.tool_calls or ():
            call = calls.setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
            if piece.id:
                assert call["id"] is None, "a call's id comes once"
                call["id"] = piece.id
            if piece.function and piece.function.name:
                call["name"] = piece.function.name
            if piece.function and piece.function.arguments:
                call["arguments"] += piece.function.arguments
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_required_calls_validate_streamed_and_not(served: Served) -> None:
    c = client(served)
    kw: dict[str, Any] = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 200}
    for seed in range(3):
        got = c.chat.completions.create(**kw, tool_choice="required", temperature=1, seed=seed)
        choice = got.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        whole = check_calls(choice.message.tool_calls, set(SCHEMAS))
        stream = c.chat.completions.create(
            **kw, tool_choice="required", temperature=1, seed=seed, stream=True
        )
        content, calls, finish = streamed(stream)
        assert (content, finish) == ("", "tool_calls")
        assert [(x["name"], json.loads(x["arguments"])) for x in calls] == whole
        assert all(x["id"].startswith("call_") for x in calls)
    one = c.chat.completions.create(
        **kw, tool_choice="required", parallel_tool_calls=False, temperature=1, seed=7
    )
    assert len(one.choices[0].message.tool_calls) == 1


def test_a_named_function_is_called_with_valid_arguments(served: Served) -> None:
    c = client(served)
    named = {"type": "function", "function": {"name": "get_time"}}
    kw: dict[str, Any] = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 100}
    for seed in range(2):
        got = c.chat.completions.create(**kw, tool_choice=named, temperature=1, seed=seed)
        choice = got.choices[0]
        assert choice.finish_reason == "stop"  # OpenAI's (and vLLM's) for a named function
        [(_, args)] = check_calls(choice.message.tool_calls, {"get_time"})
        content, calls, finish = streamed(
            c.chat.completions.create(
                **kw, tool_choice=named, temperature=1, seed=seed, stream=True
            )
        )
        assert (content, finish, len(calls)) == ("", "stop", 1)
        assert calls[0]["name"] == "get_time" and json.loads(calls[0]["arguments"]) == args


def test_auto_reads_a_hermes_call_and_the_content_before_it(served: Served) -> None:
    """The model is made to write text and then a call (a regex): the hermes parser gives
    the text as content and the call as a tool call, streamed or not, and the streamed
    content never shows a piece of the call's markup."""
    c = client(served)
    regex = literal("Checking. " + HERMES_CALL)
    kw: dict[str, Any] = {
        "model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 200,
        "extra_body": {"structured_outputs": {"regex": regex}},
    }  # fmt: skip
    got = c.chat.completions.create(**kw)
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content == "Checking. "
    [(name, args)] = check_calls(choice.message.tool_calls, set(SCHEMAS))
    assert (name, args) == ("get_weather", {"city": "Lyon", "days": 2, "metric": True})
    content, calls, finish = streamed(c.chat.completions.create(**kw, stream=True))
    assert (content, finish) == ("Checking. ", "tool_calls")
    assert [(x["name"], json.loads(x["arguments"])) for x in calls] == [(name, args)]
    none = c.chat.completions.create(**kw, tool_choice="none").choices[0]
    assert none.message.tool_calls is None and none.finish_reason == "stop"
    assert none.message.content == "Checking. " + HERMES_CALL


def test_a_tool_loop_history_renders_and_extends_the_last_prompt(served: Served) -> None:
    """A second turn carries the first's call (a Hermes call, read by the parser) and the
    tool's result: its prompt begins with the first turn's prompt and output token for
    token, so every full block of both is a cache hit on the second turn."""
    c = client(served)
    regex = literal(HERMES_CALL)
    kw: dict[str, Any] = {"model": MODEL, "tools": TOOLS, "temperature": 0, "max_tokens": 200}
    first = c.chat.completions.create(
        **kw, messages=ASK, extra_body={"structured_outputs": {"regex": regex}}
    )
    msg = first.choices[0].message
    assert msg.tool_calls and first.choices[0].finish_reason == "tool_calls"
    history = [
        *ASK,
        msg.model_dump(exclude_none=True),
        *({"role": "tool", "tool_call_id": t.id, "content": '{"temp": 21}'}
          for t in msg.tool_calls),
    ]  # fmt: skip
    named = {"type": "function", "function": {"name": "get_weather"}}
    second = c.chat.completions.create(**kw, messages=history, tool_choice=named)
    check_calls(second.choices[0].message.tool_calls, {"get_weather"})
    assert first.usage is not None and second.usage is not None
    done = first.usage.prompt_tokens + first.usage.completion_tokens
    assert second.usage.prompt_tokens > done
    # The last token sampled was never fed back: its KV does not exist.
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= (done - 1) // 16 * 16, (cached, first.usage, second.usage)


def literal(text: str) -> str:
    """``text`` as a regular expression that matches only it."""
    return "".join("\\" + ch if ch in "\\{}[]().*+?|^$" else ch for ch in text)


def post(served: Served, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        served.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": ASK, "max_tokens": 5, **body},
        headers={"authorization": "Bearer key-a"},
        timeout=60,
    )


BAD: list[tuple[dict[str, Any], str]] = [
    ({"tools": {"name": "f"}}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
    ({"tools": [*TOOLS, TOOLS[0]]}, "tools.2.function.name"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
        "tools.0.function.parameters",
    ),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice.function.name",
    ),
    (
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "tool_choice",
    ),
    (
        {
            "messages": [
                *ASK,
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "get_time", "arguments": "{not json"},
                        }
                    ],
                },
            ],
            "tools": TOOLS,
        },
        "messages.1.tool_calls.0.function.arguments",
    ),
]


@pytest.mark.parametrize(("body", "param"), BAD, ids=[b[1] for b in BAD])
def test_bad_tools_are_refused_naming_the_field(
    served: Served, body: dict[str, Any], param: str
) -> None:
    err = assert_clean_error(post(served, body), 400)
    assert err["param"] == param, err


def test_tools_on_completions_stay_refused(served: Served) -> None:
    r = httpx.post(
        served.url + "/v1/completions",
        json={"model": MODEL, "prompt": "x", "tools": TOOLS},
        headers={"authorization": "Bearer key-a"},
        timeout=60,
    )
    assert assert_clean_error(r, 400)["param"] == "tools"


def test_auto_needs_the_parser_flags() -> None:
    with pytest.raises(ValueError, match="tool-call-parser"):
        ToolConfig(None, auto=True)
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        ToolConfig("nope")
    assert ToolConfig("mistral").parser == "mistral"


def test_serve_and_router_take_vllms_tool_flags() -> None:
    from kvroute.deploy.cli import build_parser

    parser = build_parser()
    for command in ("serve", "router"):
        args = parser.parse_args(
            [command, "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"]
        )
        assert (args.enable_auto_tool_choice, args.tool_call_parser) == (True, "llama3_json")
        plain = parser.parse_args([command])
        assert (plain.enable_auto_tool_choice, plain.tool_call_parser) == (False, None)
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--tool-call-parser", "pythonic"])
    from kvroute.deploy.serve_checks import check_front_door

    for command in ("serve", "router"):
        alone = parser.parse_args([command, "--enable-auto-tool-choice"])
        assert "--tool-call-parser" in (check_front_door(alone) or "")


def test_tokenize_renders_a_chat_with_tools_as_the_chat_does(served: Served) -> None:
    """/tokenize with ``messages`` and ``tools`` counts the very prompt a chat with them
    sends (history calls and results included)."""
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
    ]  # fmt: skip
    auth = {"authorization": "Bearer key-a"}
    chat = client(served).chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=1
    )
    r = httpx.post(served.url + "/tokenize", json={"messages": history, "tools": TOOLS},
                   headers=auth, timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text
    assert chat.usage is not None and r.json()["count"] == chat.usage.prompt_tokens
    bare = httpx.post(served.url + "/tokenize", json={"messages": ASK}, headers=auth, timeout=60)
    assert bare.json()["count"] < r.json()["count"]  # the tools and the turns are in it


def test_several_choices_each_call_streamed_and_not(served: Served) -> None:
    """``n`` > 1 with tools: every choice's calls validate, whole and streamed (choices
    interleaved by index), and a streamed choice's calls are the whole answer's."""
    c = client(served)
    kw: dict[str, Any] = {
        "model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 200,
        "tool_choice": "required", "temperature": 1, "seed": 11, "n": 2,
    }  # fmt: skip
    whole = c.chat.completions.create(**kw)
    expect = {ch.index: check_calls(ch.message.tool_calls, set(SCHEMAS)) for ch in whole.choices}
    got: dict[int, dict[int, dict[str, str]]] = {0: {}, 1: {}}
    finish = {}
    for chunk in c.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            for piece in ch.delta.tool_calls or ():
                call = got[ch.index].setdefault(piece.index, {"name": "", "arguments": ""})
                call["name"] += piece.function.name or ""
                call["arguments"] += piece.function.arguments or ""
            finish[ch.index] = ch.finish_reason or finish.get(ch.index)
    assert finish == {0: "tool_calls", 1: "tool_calls"}
    for i in (0, 1):
        calls = [got[i][k] for k in sorted(got[i])]
        assert [(x["name"], json.loads(x["arguments"])) for x in calls] == expect[i]
