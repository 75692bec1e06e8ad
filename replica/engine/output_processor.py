"""The output side of :class:`~.llm_engine.LLMEngine`'s step: per-request state, text, outputs.

Split out of :mod:`.llm_engine` so that file holds the engine's loop (intake, schedule,
run, publish) and this one what a step makes of each request's new tokens, as vLLM v1's
``OutputProcessor`` does: incremental detokenization, stop strings, the
:class:`RequestOutput` or data-plane :class:`GenerateDelta` it hands back, and ending one
request alone with ``finish_reason="error"`` when a fault is its own. A mixin of
``LLMEngine``: its methods use the engine's scheduler, runner and tokenizer.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from kvroute.events.kv_transfer import KVHandoff

from ..core.detokenizer import IncrementalDetokenizer
from ..core.outputs import EngineOutput, SampledToken, request_output, step_delta
from ..core.request import Request, RequestStatus

if TYPE_CHECKING:
    from ..core.scheduler import Scheduler

log = logging.getLogger("kvroute.replica.engine.llm_engine")  # the engine's log, as before


class RequestState:
    """Per-request output bookkeeping that the scheduler need not know."""

    __slots__ = (
        "deltas",
        "detok",
        "detokenizes",
        "handoff",
        "logprobs",
        "prompt",
        "request",
        "resumed_chars",
        "sent_tokens",
    )

    def __init__(
        self,
        request: Request,
        prompt: str | None,
        detok: IncrementalDetokenizer,
        detokenizes: bool,
        deltas: bool,
    ) -> None:
        self.request = request
        self.prompt = prompt
        self.detok = detok
        self.detokenizes = detokenizes  # text every step: streaming, or stop strings to watch
        self.deltas = deltas  # outputs are GenerateDelta (see LLMEngine.add_request)
        self.sent_tokens = request.num_output_tokens  # a resumed request's are sent already
        self.resumed_chars = 0  # text of those tokens the client already has
        self.handoff: KVHandoff | None = None  # set when it ends with "handoff"
        self.logprobs: list[dict[int, float]] | None = (
            [{} for _ in range(self.sent_tokens)]
            if request.sampling_params.logprobs is not None
            else None
        )


class OutputProcessor:
    """:class:`~.llm_engine.LLMEngine`'s per-request outputs and failures (its attributes)."""

    _states: dict[str, RequestState]
    scheduler: Scheduler
    runner: Any
    tokenizer: Any
    num_request_failures: int

    if TYPE_CHECKING:  # the engine's own

        def _hand_off(self, req: Request) -> KVHandoff: ...

    def _fail(self, request_id: str, stage: str, exc: Exception | None) -> EngineOutput:
        """Ends one request with ``finish_reason="error"`` (its blocks freed now); the text
        already produced is kept, nothing is decoded again."""
        state = self._states[request_id]
        req = state.request
        self.num_request_failures += 1
        if exc is not None:
            log.warning("request %s failed in %s", request_id, stage, exc_info=exc)
            req.error = f"{stage} failed: {type(exc).__name__}"
        elif req.error is None:
            req.error = f"{stage} failed"
        if not req.is_finished:
            self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ERROR)
        req.status = RequestStatus.FINISHED_ERROR  # also over a finish the output never told
        self._forget(request_id)
        if state.deltas:
            return step_delta(req, [], "", None, None)
        text = state.detok.text[: state.detok.sent]
        return request_output(req, state.prompt, text, [], "", None, None)

    def _on_update(self, req: Request, sampled: SampledToken | None) -> EngineOutput:
        state = self._states[req.request_id]
        if sampled is not None and state.logprobs is not None:
            entry = dict(sampled.top_logprobs or {})
            entry[sampled.token_id] = sampled.logprob if sampled.logprob is not None else 0.0
            state.logprobs.append(entry)
        output_ids = req.output_token_ids
        new_ids = output_ids[state.sent_tokens :]
        state.sent_tokens = len(output_ids)
        delta = ""
        if state.detokenizes:
            detok = state.detok
            # A stop token (EOS, stop_token_ids) ends the request but is no text, as in vLLM.
            finished = req.is_finished
            text_ids = new_ids[:-1] if finished and _stopped_by_token(req) else new_ids
            delta = detok.update(text_ids, finished)
            if detok.stop_string is not None:
                req.stop_reason = detok.stop_string
                if finished:  # max_tokens hit on the token that completed the string:
                    req.status = RequestStatus.FINISHED_STOPPED  # the string wins (vLLM)
                else:
                    self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
        if req.kv_handoff and not req.is_finished:  # its first token: decode goes elsewhere
            state.handoff = self._hand_off(req)
        out = self._output(state, new_ids, delta)
        if req.is_finished:
            self._forget(req.request_id)
        return out

    def _output(self, state: RequestState, new_ids: list[int], delta: str) -> EngineOutput:
        req = state.request
        # A handoff is no end of the text: held-back text (a stop string's possible start)
        # stays held, and the replica that goes on sends it, or the whole text at its end.
        finished = req.is_finished and state.handoff is None
        text = ""
        if state.detokenizes:
            if finished:
                delta += state.detok.flush()
            text = state.detok.text
        elif finished:
            ids = req.output_token_ids[:-1] if _stopped_by_token(req) else req.output_token_ids
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            delta = text[state.resumed_chars :]  # a resumed request's client has the rest
        logprobs, stop_reason = state.logprobs, req.stop_reason
        if state.deltas:
            out = step_delta(req, new_ids, delta, logprobs, stop_reason)
            if state.handoff is not None:
                out.kv_handoff = state.handoff
            return out
        out = request_output(req, state.prompt, text, new_ids, delta, logprobs, stop_reason)
        out.kv_handoff = state.handoff
        return out

    def _forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)
        self.runner.forget(request_id)


def _stopped_by_token(req: Request) -> bool:
    """Finished by EOS or a stop token id: its last token is the stop, not output text.

    Only valid where stop strings cannot have set the status yet (or are not watched).
    """
    return req.status == RequestStatus.FINISHED_STOPPED and not isinstance(req.stop_reason, str)
