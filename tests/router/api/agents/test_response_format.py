"""Structured outputs through the real front door: OpenAI's ``response_format`` (the
``openai`` client's own ``parse`` helper included) and vLLM's ``structured_outputs``, on a
random-weight model whose unconstrained text parses as nothing."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import openai
import pydantic
import pytest

from ...served import MODEL, Served, assert_clean_error, serve_model

CONFIG = {"model": MODEL, "block_size": 16, "num_blocks": 160}
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}


class Verdict(pydantic.BaseModel):
    answer: Literal["yes", "no"]
    sure: bool


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serve_model("so", 1, CONFIG) as s:
        yield s


def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key="key-a", max_retries=0, timeout=60)


def test_the_openai_clients_parse_gets_its_pydantic_model(served: Served) -> None:
    """``chat.completions.parse`` sends a strict ``json_schema`` made from the model and
    parses the answer into it; both greedy and sampled answers parse."""
    c = client(served)
    for temperature in (0.0, 1.0):
        got = c.chat.completions.parse(
            model=MODEL,
            messages=[{"role": "user", "content": "Is the sky green?"}],
            response_format=Verdict,
            max_tokens=200,
            temperature=temperature,
            seed=3,
        )
        msg = got.choices[0].message
        assert got.choices[0].finish_reason == "stop", msg.content
        assert isinstance(msg.parsed, Verdict)


def test_json_mode_regex_and_choice_on_completions(served: Served) -> None:
    c = client(served)
    kw: dict[str, Any] = {"model": MODEL, "prompt": "Say it: ", "max_tokens": 120}
    obj = c.completions.create(
        **kw, temperature=0, extra_body={"response_format": {"type": "json_object"}, **COMPACT}
    ).choices[0]
    assert obj.finish_reason == "stop" and isinstance(json.loads(obj.text, strict=False), dict)
    for seed in range(3):
        so = {"regex": r"[A-Z]{2}-[0-9]{4}"}
        text = (
            c.completions.create(
                **kw, temperature=1, seed=seed, extra_body={"structured_outputs": so}
            )
            .choices[0]
            .text
        )
        assert re.fullmatch(r"[A-Z]{2}-[0-9]{4}", text)
    colours = ["red", "green", "blue"]
    texts = c.completions.create(
        **kw, temperature=1, seed=1, n=4, extra_body={"structured_outputs": {"choice": colours}}
    )
    assert all(ch.text in colours for ch in texts.choices)


def test_a_streamed_constrained_answer_is_whole(served: Served) -> None:
    c = client(served)
    schema = Verdict.model_json_schema()
    chunks = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Well?"}],
        max_tokens=200,
        temperature=0,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "v", "schema": schema}},
        extra_body=COMPACT,
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert isinstance(Verdict.model_validate_json(text), Verdict), text  # raises if not


def test_a_bad_constraint_is_a_400_that_says_what(served: Served) -> None:
    url, auth = served.url + "/v1/chat/completions", {"Authorization": "Bearer key-a"}
    base = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    for extra, param, words in (
        ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "name"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "one"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "structural"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "JSON"),
        # Refused by the replica's compiler, in its words, the field still named:
        ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs", "parenthesis"),
        ({"structured_outputs": {"json": {"type": "nonsense"}}}, "structured_outputs", "nonsense"),
    ):
        r = httpx.post(url, json={**base, **extra}, headers=auth)
        err = assert_clean_error(r, 400)
        assert words in err["message"] and ".cc" not in err["message"], err
        assert err["param"] == param, err


def test_forbidden_alternatives_show_as_very_unlikely_not_null(served: Served) -> None:
    """With one allowed token, the others a client asks logprobs for are -inf after the
    mask: shown as -9999 (JSON has no -inf, and null breaks clients), as vLLM shows them."""
    c = client(served)
    got = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Pick."}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"structured_outputs": {"choice": ["yes"]}},
    ).choices[0]
    assert got.message.content == "yes"
    for entry in got.logprobs.content:
        assert all(isinstance(t.logprob, float) for t in entry.top_logprobs), entry
        assert -9999.0 in [t.logprob for t in entry.top_logprobs]
