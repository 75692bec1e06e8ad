"""Resuming a request on another engine (a failover) continues it exactly.

Why it matters: when a replica dies mid-stream, the front door resends the prompt and the
tokens already streamed to another replica; the client must see one uninterrupted stream.
So a resumed request, cut after any token, must produce the very tokens and text the
uninterrupted one did -- greedy, seeded (its generator past the draws already taken), and
with a stop string whose held-back text straddles the cut.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import msgspec
import pytest

from kvroute.events.replica_api import Resume
from kvroute.replica import LLMEngine, SamplingParams

PROMPTS = ["Once upon a time, far away", "failover drill"]  # the second: broken UTF-8
N = 20
_ids = itertools.count()


@dataclass
class Step:
    text: str
    token_ids: list[int]


@dataclass
class Run:
    steps: list[Step]
    finish_reason: str | None

    @property
    def text(self) -> str:
        return "".join(s.text for s in self.steps)

    @property
    def token_ids(self) -> list[int]:
        return [t for s in self.steps for t in s.token_ids]


@pytest.fixture(scope="module")
def engine(tiny_engine: LLMEngine) -> LLMEngine:
    return tiny_engine


def run(
    engine: LLMEngine, params: SamplingParams, resume: Resume | None = None, prompt: int = 0
) -> Run:
    rid = f"r{next(_ids)}"
    engine.add_request(rid, PROMPTS[prompt], params, resume=resume)
    # A bystander shares every step, as on a busy replica.
    engine.add_request(f"b{next(_ids)}", "bystander", SamplingParams(max_tokens=N, seed=1))
    steps, finish = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                steps.append(Step(out.delta_text, list(out.delta_token_ids)))
                finish = out.outputs[0].finish_reason if out.finished else finish
    return Run(steps, finish)


def cut(full: Run, k: int) -> Resume:
    """What the front door knows after the step that streamed the ``k``-th token."""
    tokens, chars = 0, 0
    for s in full.steps:
        tokens += len(s.token_ids)
        chars += len(s.text)
        if tokens >= k:
            return Resume(output_token_ids=full.token_ids[:k], sent_chars=chars)
    raise AssertionError(f"the run has fewer than {k} tokens")


GREEDY = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=1234, top_k=40, max_tokens=N, ignore_eos=True)


@pytest.mark.parametrize("prompt", [0, 1])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("k", [1, 7, N - 1])
def test_a_resumed_request_continues_exactly(
    engine: LLMEngine, params: SamplingParams, k: int, prompt: int
) -> None:
    full = run(engine, params, prompt=prompt)
    assert len(full.token_ids) == N
    resume = cut(full, k)
    rest = run(engine, params, resume, prompt=prompt)
    assert resume.output_token_ids + rest.token_ids == full.token_ids
    assert full.text[: resume.sent_chars] + rest.text == full.text
    assert rest.finish_reason == full.finish_reason == "length"


def test_a_stop_string_across_the_cut(engine: LLMEngine) -> None:
    """Text held back for a possible stop string is rebuilt on the new engine: the stop
    is found, and nothing of it reaches the client."""
    free = run(engine, SEEDED)
    stop = free.text[8:11]  # some text the seeded run will produce past token 5
    assert stop and stop not in free.text[:8]
    params = msgspec.structs.replace(SEEDED, stop=[stop])
    full = run(engine, params)
    assert full.finish_reason == "stop" and stop not in full.text
    resume = cut(full, 5)
    rest = run(engine, params, resume)
    assert full.text[: resume.sent_chars] + rest.text == full.text
    assert rest.finish_reason == "stop"


def test_a_resume_with_nothing_left_is_refused(engine: LLMEngine) -> None:
    with pytest.raises(ValueError, match="left to generate"):
        engine.add_request("done", PROMPTS[0], GREEDY, resume=Resume(output_token_ids=[5] * N))
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request("bad", PROMPTS[0], GREEDY, resume=Resume(output_token_ids=[10_000]))
    assert not engine.has_unfinished_requests()
