"""Several choices in one answer: a batch of prompts, ``n`` > 1, or both.

Why runs side by side: each choice is a request of its own (its own admission ticket,
route and replica, as vLLM runs ``n`` as parallel requests), so ``n`` samples of one prompt
share its cached prefix wherever the router sends them, and the choices decode in the same
engine steps. The answer is one JSON body once all have finished (streamed, they are
:mod:`.stream`'s); any choice that fails fails the request, and every run is closed.
``best_of`` runs that many candidates per prompt and answers with the ``n`` likeliest.
Metrics and the request log count each choice as a request; ``x-kvroute-replica`` lists
the replicas that answered, in choice order, each once.

On a request's path (see :mod:`.app`) this is the last stop, in place of
:func:`.responses.respond`, with the same parts (:class:`~.responses.ResponseContext`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ...fleet.request_run import REPLICA_FAILURES, RequestRun
from ..errors import FAILED, APIError, one_line, request_failed
from ..intake import ranked, runs_per_prompt
from ..metrics import end_request
from ..openai_api import make_choice, make_response, make_usage
from ..responses import (
    DISCONNECT_POLL_S,
    FLOOR,
    REPLICA_HEADER,
    Collected,
    Logprobs,
    ResponseContext,
    await_first_delta,
    log,
    response_id,
)

if TYPE_CHECKING:
    from ..agents.tools import ToolPlan
    from .echo import Echo


async def respond_choices(
    ctx: ResponseContext,
    request: Request,
    rid: str,
    body: Any,
    runs: list[RequestRun],
    arrival: float | None = None,
    echo: Echo | None = None,
    tools: ToolPlan | None = None,
) -> Response:
    """Every run's answer as one body, a choice per run in order. Each run's first delta
    is awaited here (:func:`~.responses.await_first_delta`: the status of a failure before
    it); usage counts each prompt once (runs ``n`` apart share one) and every choice's
    output. ``body``: the request's, checked; ``echo``: the prompts to put ahead;
    ``tools``: a chat's tool plan (each choice's text read as calls)."""
    chat, n, model = body.chat, runs_per_prompt(body), body.model
    resp_id = response_id(chat)
    top = body.num_logprobs()
    names: dict[int, str] = {}  # token names, decoded once for all the choices
    got = [Collected() for _ in runs]

    async def answer(c: Collected, run: RequestRun) -> None:
        await await_first_delta(run, rid, echo)
        await c.collect(run)

    tasks = [asyncio.ensure_future(answer(c, run)) for c, run in zip(got, runs, strict=True)]
    try:
        pending: set[asyncio.Future[None]] = set(tasks)
        while pending:
            done, pending = await asyncio.wait(
                pending, timeout=DISCONNECT_POLL_S, return_when=asyncio.FIRST_EXCEPTION
            )
            for t in done:
                t.result()  # the first failure, as its status (a run's own, or a replica's)
            if pending and not done and await request.is_disconnected():
                ctx.errors["client_gone"] += 1
                return Response(status_code=499)
    except REPLICA_FAILURES as exc:
        log.warning("request %s: replica failed mid-request: %s", rid, one_line(str(exc)))
        for c, run in zip(got, runs, strict=True):
            end_request(ctx.metrics, rid, run, c.last, None, "503 replica_failed", arrival)
        raise APIError(503, FAILED, "service_unavailable", code="replica_failed") from None
    finally:
        await cancel_all(tasks)
        for run in runs:
            run.close()
    ttft_s = None if arrival is None else time.perf_counter() - arrival
    for c, run in zip(got, runs, strict=True):
        if c.last is None or c.last.finish_reason == "error":
            end_request(ctx.metrics, rid, run, c.last, ttft_s, "500 request_failed", arrival)
            raise request_failed(rid, c.last)
    choices = []
    kept = _best(got, n, body.n or 1) if ranked(body) else set(range(len(runs)))
    for i, (c, run) in enumerate(zip(got, runs, strict=True)):
        last = c.last
        end_request(ctx.metrics, rid, run, last, ttft_s, f"200 {last.finish_reason}", arrival)
        if i not in kept:
            continue
        shaped = None
        if top is not None:  # each choice's shaped afresh: its ``text_offset`` from 0
            shapes = Logprobs(ctx.tokenizer, top, names)
            shaped = (shapes.chat if chat else shapes.completion)(c.ids, c.entries)
        text: str | None = c.text()
        finish, calls = last.finish_reason, None
        if tools is not None:
            text, parsed = tools.read(c.tool_text(tools))
            finish, calls = tools.finish_reason(finish, parsed), tools.tool_calls(parsed)
        choices.append(make_choice(chat, len(choices), text, finish, shaped, calls))
    replicas = ",".join(dict.fromkeys(str(run.replica) for run in runs))
    usage = choices_usage([c.last for c in got], n)
    body_out = make_response(chat, resp_id, model, choices, usage)
    return JSONResponse(body_out, headers={REPLICA_HEADER: replicas})


async def cancel_all(tasks: list[asyncio.Future[Any]]) -> None:
    """Every run's task cancelled, then each awaited to its end (what it raises is moot by
    then: the request has its answer or its error), so none outlives the request."""
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(BaseException):
            await t


def choices_usage(lasts: list[Any], n: int) -> Any:
    """The usage of several choices, whole or streamed (:mod:`.stream`): each
    prompt once (its ``n`` runs share it; candidates ``best_of`` drops count too), every
    choice's output. ``lasts``: each run's last delta, in choice order."""
    prompt = cached = output = 0
    by_tier: dict[str, int] = {}
    for i, last in enumerate(lasts):
        if i % n == 0:
            prompt += last.num_prompt_tokens
            cached += last.num_cached_tokens
            for tier, k in (getattr(last, "num_tier_cached_tokens", None) or {}).items():
                by_tier[tier] = by_tier.get(tier, 0) + k
        output += last.num_output_tokens
    return make_usage(prompt, output, cached, by_tier)


def _best(got: list[Collected], per_prompt: int, n: int) -> set[int]:
    """``best_of``: of each prompt's ``per_prompt`` candidates, the ``n`` whose output
    tokens have the highest summed logprob (vLLM's rule before v1; OpenAI's "highest log
    probability per token"), kept in their order."""
    kept: set[int] = set()
    for start in range(0, len(got), per_prompt):
        group = range(start, min(start + per_prompt, len(got)))
        kept.update(sorted(group, key=lambda i: -_score(got[i]))[:n])
    return kept


def _score(c: Collected) -> float:
    made = c.last.num_output_tokens if c.last is not None else 0
    tail = list(zip(c.ids, c.entries, strict=True))[len(c.ids) - made :] if made else []
    return sum((e or {}).get(t, FLOOR) for t, e in tail)
