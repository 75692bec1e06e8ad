"""OpenAI's ``echo``: the prompt given back ahead of its completion.

Why the first delta is rewritten rather than each response shape taught about prompts: the
prompt then reaches a client exactly as a completion's own tokens do -- in one JSON body or
in the first SSE chunk, for one choice or several -- with its text, its token names and, when
``logprobs`` is set, its logprobs, which the replica computed for every prompt token
(``SamplingParams.prompt_logprobs``; the first token's entry is null, nothing precedes it).
Evaluation harnesses (lm-evaluation-harness's loglikelihood tasks) score prompts this way.

``max_tokens: 0`` asks for the prompt alone: the replica makes one token, which is dropped
here, and the usage counts no completion tokens (vLLM makes and drops the token the same way).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from kvroute.events.replica_api import GenerateDelta

from ...fleet.request_run import RequestRun


class Echo:
    """The prompts of one request's runs, to put ahead of each run's first delta."""

    def __init__(self, texts: Sequence[str], runs: Sequence[RequestRun], *, alone: bool) -> None:
        """``texts``: each run's prompt as the client sent it (a text, or its ids decoded)."""
        self._texts = {id(run): text for run, text in zip(runs, texts, strict=True)}
        self.alone = alone

    @classmethod
    def of(
        cls,
        prompts: Sequence[Any],
        runs: Sequence[RequestRun],
        n: int,
        decode: Callable[[list[int]], str],
        *,
        alone: bool,
    ) -> Echo:
        """The prompts to echo, run by run (``n`` runs per prompt, prompt by prompt): each
        as sent, or its token ids decoded."""
        texts = []
        for i, run in enumerate(runs):
            prompt = prompts[i // n]
            ids = run.request.prompt_token_ids
            texts.append(prompt if isinstance(prompt, str) else decode(ids))
        return cls(texts, runs, alone=alone)

    def put_ahead(self, run: RequestRun) -> None:
        """The run's prompt put ahead of its first delta (which must be in)."""
        assert run.first is not None
        run.first = echoed(
            run.first, run.request.prompt_token_ids, self._texts[id(run)], self.alone
        )


def echoed(first: GenerateDelta, prompt_ids: list[int], text: str, alone: bool) -> GenerateDelta:
    """``first`` with the prompt ahead of its tokens (``alone``: in their place). Logprob
    entries go with it when the run has them: the prompt's, then the first delta's own."""
    entries = None
    if first.logprobs is not None:
        given = first.prompt_logprobs
        prompt_entries: list[dict[int, float] | None] = (
            list(given) if given is not None else [None] * len(prompt_ids)
        )
        entries = prompt_entries if alone else [*prompt_entries, *first.logprobs]
    if alone:
        return msgspec.structs.replace(
            first,
            delta_token_ids=list(prompt_ids),
            delta_text=text,
            logprobs=entries,
            num_output_tokens=0,
            prompt_logprobs=None,
        )
    return msgspec.structs.replace(
        first,
        delta_token_ids=[*prompt_ids, *first.delta_token_ids],
        delta_text=text + first.delta_text,
        logprobs=entries,
        prompt_logprobs=None,
    )
