"""Several choices streamed (``n`` > 1, a batch of prompts) and ``best_of``, on both
completion endpoints, through the real front door with the ``openai`` client: two ``tiny``
replicas, so a request's choices run side by side (on either)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from ...served import MODEL, Served, assert_clean_error, serve_model

CONFIG = {"model": MODEL, "block_size": 16, "num_blocks": 256}
SAMPLED: dict[str, Any] = {"temperature": 1.0, "seed": 5, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serve_model("ns", 2, CONFIG) as s:
        yield s


def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key="key-a", max_retries=0, timeout=120)


def gather(stream: Any, chat: bool) -> tuple[dict[int, str], dict[int, str | None], list[int], Any]:
    """Text and finish reason per choice, the choice index of every chunk in order, the
    usage chunk's usage."""
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    order: list[int] = []
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            assert finish.get(ch.index) is None, "a chunk after its choice finished"
            order.append(ch.index)
            piece = (ch.delta.content or "") if chat else ch.text
            texts[ch.index] = texts.get(ch.index, "") + piece
            finish[ch.index] = ch.finish_reason
    return texts, finish, order, usage


def interleaved(order: list[int]) -> bool:
    """Whether some choice's chunk comes after a later choice's (not one block each)."""
    return any(b < a for a, b in itertools.pairwise(order))


def test_completions_n_streamed_equals_the_whole_answer(served: Served) -> None:
    c = client(served)
    kw: dict[str, Any] = {"model": MODEL, "prompt": "Once upon", "max_tokens": 24, "n": 3}
    whole = c.completions.create(**kw, **SAMPLED)
    texts, finish, order, usage = gather(
        c.completions.create(**kw, **SAMPLED, stream=True, stream_options={"include_usage": True}),
        chat=False,
    )
    assert texts == {ch.index: ch.text for ch in whole.choices}
    assert len(set(texts.values())) == 3  # seeded choices differ
    assert finish == {0: "length", 1: "length", 2: "length"}
    assert interleaved(order), order
    assert usage.completion_tokens == 3 * 24 == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens  # the prompt counted once


def test_a_batch_streams_n_choices_per_prompt_indexed_prompt_by_prompt(served: Served) -> None:
    c = client(served)
    kw: dict[str, Any] = {"model": MODEL, "prompt": ["Alpha", "Beta gamma"], "max_tokens": 6}
    whole = c.completions.create(**kw, n=2, **SAMPLED)
    texts, finish, _, _ = gather(c.completions.create(**kw, n=2, **SAMPLED, stream=True), False)
    assert texts == {ch.index: ch.text for ch in whole.choices} and len(texts) == 4
    assert set(finish.values()) == {"length"}


def test_chat_n_streamed_gives_each_choice_its_role_and_finish(served: Served) -> None:
    c = client(served)
    kw: dict[str, Any] = {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12,
        "n": 3,
    }  # fmt: skip
    whole = c.chat.completions.create(**kw, **SAMPLED)
    roles: dict[int, int] = {}
    chunks = list(c.chat.completions.create(**kw, **SAMPLED, stream=True))
    for chunk in chunks:
        for ch in chunk.choices:
            if ch.delta.role == "assistant":
                roles[ch.index] = roles.get(ch.index, 0) + 1
    assert roles == {0: 1, 1: 1, 2: 1}
    texts, finish, order, _ = gather(iter(chunks), chat=True)
    assert texts == {ch.index: ch.message.content for ch in whole.choices}
    assert set(finish.values()) == {"length"} and interleaved(order)


def test_best_of_answers_with_the_likeliest_candidates(served: Served) -> None:
    """``best_of=3`` runs the three candidates ``n=3`` would (same seeds) and answers with
    the one whose tokens' logprobs sum highest; usage counts every candidate's output."""
    c = client(served)
    kw: dict[str, Any] = {"model": MODEL, "prompt": "The best", "max_tokens": 8, **SAMPLED}
    every = c.completions.create(**kw, n=3, logprobs=0)
    sums = [sum(ch.logprobs.token_logprobs) for ch in every.choices]
    best = c.completions.create(**kw, best_of=3)
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    assert best.choices[0].text == every.choices[sums.index(max(sums))].text
    assert best.usage.completion_tokens == 3 * 8
    two = c.completions.create(**kw, n=2, best_of=3)
    ranked = sorted(range(3), key=lambda i: -sums[i])[:2]
    assert [ch.text for ch in two.choices] == [every.choices[i].text for i in sorted(ranked)]
    assert [ch.index for ch in two.choices] == [0, 1]
    chat = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
        extra_body={"best_of": 2},
    )  # fmt: skip
    assert len(chat.choices) == 1


@pytest.mark.parametrize(
    "extra",
    [{"best_of": 3, "stream": True}, {"n": 3, "best_of": 2}, {"best_of": 0}],
    ids=json.dumps,
)
def test_best_of_refusals_name_it(served: Served, extra: dict[str, Any]) -> None:
    r = httpx.post(
        served.url + "/v1/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": 2, **extra},
        headers={"authorization": "Bearer key-a"},
        timeout=60,
    )
    assert assert_clean_error(r, 400)["param"] == "best_of"


def test_streamed_choices_each_echo_their_prompt_and_shape_their_own_logprobs(
    served: Served,
) -> None:
    c = client(served)
    stream = c.completions.create(
        model=MODEL, prompt="Echo me", max_tokens=5, n=2, echo=True, logprobs=1, stream=True,
        **SAMPLED,
    )  # fmt: skip
    texts: dict[int, str] = {}
    offsets: dict[int, list[int]] = {}
    for chunk in stream:
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            if ch.logprobs is not None:
                offsets.setdefault(ch.index, []).extend(ch.logprobs.text_offset)
    assert set(texts) == {0, 1} and all(t.startswith("Echo me") for t in texts.values())
    for i in (0, 1):
        assert offsets[i][0] == 0 and offsets[i] == sorted(offsets[i])  # each from its start
