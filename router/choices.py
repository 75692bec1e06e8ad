"""Several choices in one answer: a batch of prompts, ``n`` > 1, or both.

Why runs side by side: each choice is a request of its own (its own admission ticket,
route and replica, as vLLM runs ``n`` as parallel requests), so ``n`` samples of one prompt
share its cached prefix wherever the router sends them, and the choices decode in the same
engine steps. The answer is one JSON body once all have finished (streaming several choices
is refused at intake); any choice that fails fails the request, and every run is closed.
Metrics and the request log count each choice as a request; ``x-kvroute-replica`` lists
the replicas that answered, in choice order, each once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from .errors import APIError, one_line, request_id
from .frontdoor import FrontDoor
from .openai_api import make_usage
from .request_run import REPLICA_FAILURES, RequestRun
from .responses import (
    DISCONNECT_POLL_S,
    FAILED,
    REPLICA_HEADER,
    Collected,
    end_request,
    log,
    request_failed,
)


async def respond_choices(
    door: FrontDoor,
    request: Request,
    runs: list[RequestRun],
    n: int,
    first: Callable[[RequestRun], Awaitable[None]],
    choice: Callable[[int, str, str | None, Any], Any],
    body: Callable[[list[Any], Any], dict[str, Any]],
    logprobs: Callable[[list[int], list[dict[int, float]] | None], Any] | None = None,
    arrival: float | None = None,
) -> Response:
    """Every run's answer as one body: ``choice(index, text, finish, logprobs)`` per run,
    in order, and ``body(choices, usage)``. ``first`` waits for a run's first delta (the
    status of a failure before it); usage counts each prompt once (runs ``n`` apart share
    one) and every choice's output."""
    rid = request_id(request)
    got = [Collected() for _ in runs]

    async def answer(c: Collected, run: RequestRun) -> None:
        await first(run)
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
                door.errors["client_gone"] += 1
                return Response(status_code=499)
    except REPLICA_FAILURES as exc:
        log.warning("request %s: replica failed mid-request: %s", rid, one_line(str(exc)))
        for c, run in zip(got, runs, strict=True):
            end_request(rid, run, c.last, None, "503 replica_failed", arrival)
        raise APIError(503, FAILED, "service_unavailable", code="replica_failed") from None
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
        for run in runs:
            run.close()
    ttft_s = None if arrival is None else time.perf_counter() - arrival
    for c, run in zip(got, runs, strict=True):
        if c.last is None or c.last.finish_reason == "error":
            end_request(rid, run, c.last, ttft_s, "500 request_failed", arrival)
            raise request_failed(rid, c.last)
    prompt = cached = output = 0
    choices = []
    for i, (c, run) in enumerate(zip(got, runs, strict=True)):
        last = c.last
        if i % n == 0:
            prompt += last.num_prompt_tokens
            cached += last.num_cached_tokens
        output += last.num_output_tokens
        end_request(rid, run, last, ttft_s, f"200 {last.finish_reason}", arrival)
        shaped = logprobs(c.ids, c.entries) if logprobs is not None else None
        choices.append(choice(i, c.text(), last.finish_reason, shaped))
    replicas = ",".join(dict.fromkeys(str(run.replica) for run in runs))
    usage = make_usage(prompt, output, cached)
    return JSONResponse(body(choices, usage), headers={REPLICA_HEADER: replicas})
