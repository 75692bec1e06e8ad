"""``echo`` through the real front door and the official ``openai`` client: the prompt ahead
of its completion, its logprobs equal to transformers' own forward pass, as evaluation
harnesses (lm-evaluation-harness's loglikelihood requests) ask for them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvroute.replica import tiny_model_path

from ...served import MODEL, Served, assert_clean_error, serve_model

CONFIG = {"model": MODEL, "block_size": 16, "num_blocks": 160}
PROMPTS = ["The capital of France is", "Two plus two equals four, and"]
TOL = 1e-4


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serve_model("echo", 1, CONFIG) as s:
        yield s


@pytest.fixture(scope="module")
def hf() -> tuple[Any, Any]:
    path = tiny_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return model, AutoTokenizer.from_pretrained(path)


def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key="key-a", max_retries=0, timeout=60)


def reference(hf: tuple[Any, Any], prompt: str) -> tuple[list[int], torch.Tensor]:
    """The prompt's ids and, row i, the log-distribution of token i + 1 given those before."""
    model, tok = hf
    ids = list(tok(prompt).input_ids)
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return ids, torch.log_softmax(logits, dim=-1)


def check_prompt_logprobs(lp: Any, hf: tuple[Any, Any], prompt: str) -> int:
    """The first ``len(prompt ids)`` entries of ``lp`` are the prompt's; returns that count."""
    ids, ref = reference(hf, prompt)
    tok = hf[1]
    n = len(ids)
    assert lp.tokens[:n] == [tok.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, n):
        assert lp.token_logprobs[i] == pytest.approx(float(ref[i - 1, ids[i]]), abs=TOL)
        best = int(ref[i - 1].argmax())
        assert lp.top_logprobs[i][tok.decode([best])] == pytest.approx(
            float(ref[i - 1, best]), abs=TOL
        )
    offsets = [0]
    for name in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(name))
    assert lp.text_offset == offsets
    return n


def test_echo_alone_gives_the_prompt_and_its_logprobs(served: Served, hf: Any) -> None:
    c = client(served)
    prompt = PROMPTS[0]
    got = c.completions.create(
        model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    choice = got.choices[0]
    assert choice.text == prompt
    n = check_prompt_logprobs(choice.logprobs, hf, prompt)
    assert len(choice.logprobs.tokens) == n  # the token made to end the request is dropped
    assert got.usage.completion_tokens == 0 and got.usage.prompt_tokens == n
    # Sent again, the prompt is cached on the replica: its logprobs are still all there.
    again = c.completions.create(
        model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    assert again.choices[0].logprobs.token_logprobs == choice.logprobs.token_logprobs


def test_echo_puts_the_prompt_ahead_of_the_completion(served: Served, hf: Any) -> None:
    """A batch, as lm-evaluation-harness sends it (``max_tokens: 1``, ``logprobs: 1``),
    with two choices a prompt: each choice starts with its prompt and counts its own
    ``text_offset`` from 0; without ``logprobs``, only the text changes."""
    c = client(served)
    kw: dict[str, Any] = {"model": MODEL, "temperature": 0, "extra_body": {"ignore_eos": True}}
    plain = [c.completions.create(prompt=p, max_tokens=3, **kw).choices[0].text for p in PROMPTS]
    got = c.completions.create(prompt=PROMPTS, max_tokens=3, echo=True, logprobs=1, n=2, **kw)
    assert [ch.text for ch in got.choices] == [PROMPTS[i // 2] + plain[i // 2] for i in range(4)]
    for i, ch in enumerate(got.choices):
        n = check_prompt_logprobs(ch.logprobs, hf, PROMPTS[i // 2])
        assert len(ch.logprobs.tokens) == n + 3
        assert all(v is not None for v in ch.logprobs.token_logprobs[n:])
    assert got.usage.completion_tokens == 4 * 3
    text = c.completions.create(prompt=PROMPTS[1], max_tokens=3, echo=True, **kw).choices[0]
    assert text.text == PROMPTS[1] + plain[1] and text.logprobs is None


def test_a_streamed_echo_sends_the_prompt_first(served: Served, hf: Any) -> None:
    c = client(served)
    kw: dict[str, Any] = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 4, "echo": True}
    kw.update(temperature=0, logprobs=0, extra_body={"ignore_eos": True})
    whole = c.completions.create(**kw).choices[0]
    chunks = [ch.choices[0] for ch in c.completions.create(**kw, stream=True) if ch.choices]
    assert chunks[0].text.startswith(PROMPTS[1])
    assert "".join(ch.text for ch in chunks) == whole.text
    streamed = [v for ch in chunks for v in ch.logprobs.token_logprobs]
    assert streamed[0] is None and whole.logprobs.token_logprobs[0] is None
    assert streamed[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=TOL)
    offsets = [o for ch in chunks for o in ch.logprobs.text_offset]
    assert offsets == whole.logprobs.text_offset


def test_what_echo_does_not_cover_is_a_clear_400(served: Served) -> None:
    url, auth = served.url + "/v1/completions", {"Authorization": "Bearer key-a"}
    for extra, param in (
        ({"max_tokens": 0}, "max_tokens"),  # the prompt alone only with echo
        ({"prompt_logprobs": 1}, "prompt_logprobs"),  # vLLM's spelling: not served
        ({"max_tokens": -1, "echo": True}, "max_tokens"),
    ):
        r = httpx.post(url, json={"model": MODEL, "prompt": "x", **extra}, headers=auth)
        assert assert_clean_error(r, 400)["param"] == param, (extra, r.text)
