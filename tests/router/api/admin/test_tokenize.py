"""vLLM's /tokenize and /detokenize on the front door: the served model's own tokenizer,
behind the same keys and bounds as the completions."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from transformers import AutoTokenizer

from kvroute.replica import tiny_model_path

from ...served import MODEL, Served, assert_clean_error, serve_model

AUTH = {"Authorization": "Bearer key-a"}


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serve_model("tok", 1, {"model": MODEL, "num_blocks": 64}) as s:
        yield s


def post(served: Served, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(served.url + path, json=body, headers=AUTH if headers is None else headers)


def test_tokenize_and_detokenize_are_the_tokenizers_own(served: Served) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_path())
    text = "Héllo, world: ünïcode and spaces  "
    r = post(served, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert r["tokens"] == list(tok(text).input_ids) and r["count"] == len(r["tokens"])
    assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
    assert r["max_model_len"] > 0
    bare = post(served, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == list(tok(text, add_special_tokens=False).input_ids)
    assert post(served, "/detokenize", {"tokens": r["tokens"]}).json()["prompt"] == tok.decode(
        r["tokens"]
    )
    messages = [{"role": "user", "content": "hi there"}]
    chat = post(served, "/tokenize", {"model": MODEL, "messages": messages}).json()
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == list(tok(rendered, add_special_tokens=False).input_ids)


def test_bad_bodies_and_keys_are_refused_cleanly(served: Served) -> None:
    for path, body, status, param in (
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, None),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"model": "other", "prompt": "a"}, 404, "model"),  # as vLLM
        ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ):
        err = assert_clean_error(post(served, path, body), status)
        assert err["param"] == param, (path, body, err)
    assert_clean_error(post(served, "/tokenize", {"prompt": "a"}, headers={}), 401)
