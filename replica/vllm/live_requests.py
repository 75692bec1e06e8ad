"""Requests on a vLLM replica's event loop: each one a task iterating ``AsyncLLM.generate``.

Split out of :mod:`.engine` so :class:`~.engine.VllmEngine` holds the adapter's surface
and lifecycle, and this one what runs per request on the engine's loop: refusing what
vLLM cannot take, starting the task (prompt, resume, P/D ``kv_transfer_params`` through
:mod:`.disagg`), turning vLLM's outputs into data-plane deltas, aborts, one flush per sink
after each engine step, and failing every live request when vLLM's engine core dies.
``VllmRequests`` is a mixin of ``VllmEngine`` (its attributes).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from kvroute.events.kv_transfer import KVSource
from kvroute.events.replica_api import GenerateDelta, Resume, SamplingParams, next_delta

from ..engine.replica_engine import EngineDeadError, OutputSink
from .adapt import LiveRequest, from_vllm_output, to_vllm_sampling
from .disagg import handoff_delta, pd_params, with_kv_transfer

log = logging.getLogger("kvroute.replica.vllm.engine")  # the engine's log, as before


class VllmRequests:
    """:class:`~.engine.VllmEngine`'s per-request methods, run on its loop (its attributes)."""

    llm: Any  # vLLM's AsyncLLM
    tokenizer: Any
    error: BaseException | None
    _stopped: bool
    _failed: threading.Event
    _live: dict[str, LiveRequest]
    _touched: set[OutputSink]
    _flush_scheduled: bool
    _loras: dict[str, Any]
    _loop: asyncio.AbstractEventLoop

    def _call_soon(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nothing left to abort
            pass

    def _start_request(
        self,
        rid: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        sink: OutputSink,
        cache_salt: str | None,
        resume: Resume | None,
        lora_name: str | None = None,
        kv_handoff: bool = False,
        kv_source: KVSource | None = None,
        priority: int = 0,
    ) -> None:
        if self.error is not None or self._stopped:
            self._deliver_to(sink, rid, EngineDeadError("the engine has failed"))
            return
        lora = None
        if lora_name is not None:  # refused here, on the loop that delivers to this sink
            lora = self._loras.get(lora_name)
            if lora is None:
                why = ValueError(f"unknown LoRA adapter {lora_name[:100]!r} (lora_name)")
                self._deliver_to(sink, rid, why)
                return
        if rid in self._live:
            self._deliver_to(sink, rid, ValueError(f"request id {rid!r} is already in use"))
            return
        if resume is not None and resume.output_token_ids and params.structured_outputs:
            # vLLM would start the constraint again after the earlier tokens (its prompt).
            why = "a structured output cannot be resumed on a vLLM replica"
            self._deliver_to(sink, rid, ValueError(why))
            return
        if isinstance(prompt, str):
            prompt = self.tokenizer.encode(prompt)
        params = pd_params(params, kv_handoff)
        live = LiveRequest(rid, sink, len(prompt), logprobs=params.logprobs is not None)
        tokens = list(prompt)
        if resume is not None:
            # Continue as if the tokens had come from here: they join the prompt, and the
            # text the client has not had yet (held back there for stop strings) goes
            # first in this replica's first delta.
            done = list(resume.output_token_ids)
            live.num_output = len(done)
            live.pending_text = self.tokenizer.decode(done)[resume.sent_chars :] if done else ""
            tokens += done
        self._live[rid] = live
        pd = (kv_handoff, kv_source)
        serve = self._serve(live, tokens, params, cache_salt, lora, *pd, priority)
        live.task = self._loop.create_task(serve)

    async def _serve(
        self,
        live: LiveRequest,
        tokens: list[int],
        params: SamplingParams,
        salt: str | None,
        lora: Any = None,
        kv_handoff: bool = False,
        kv_source: KVSource | None = None,
        priority: int = 0,
    ) -> None:
        from vllm.v1.engine.exceptions import EngineDeadError as VllmDeadError

        rid = live.request_id
        try:
            sampling = to_vllm_sampling(params, live.num_output)
            if sampling is None:  # a resume that already reached max_tokens
                self._finish(live, next_delta(live, [], "", "length"))
                return
            sampling = with_kv_transfer(sampling, kv_handoff, kv_source)
            prompt: dict[str, Any] = {"prompt_token_ids": tokens}
            if salt:
                prompt["cache_salt"] = salt
            gen = self.llm.generate(prompt, sampling, rid, lora_request=lora, priority=priority)
            async for out in gen:
                if self._live.get(rid) is not live:
                    return  # its front door is gone (abort_sink)
                delta = from_vllm_output(live, out)
                if delta.finished:
                    if kv_handoff and delta.finish_reason in ("length", "stop"):
                        delta = handoff_delta(live, out)  # the decode side makes the token
                    self._finish(live, delta)
                    return
                self._deliver(live, delta)
        except asyncio.CancelledError:  # abort(): vLLM has aborted it in generate()
            if self._live.get(rid) is live:
                self._finish(live, next_delta(live, [], "", "abort"))
        except VllmDeadError as exc:
            self._died(exc)
        except Exception as exc:  # vLLM refused it (too long, bad parameters): a 4xx
            if self._live.get(rid) is live:
                del self._live[rid]
                self._deliver_to(live.sink, rid, ValueError(f"request rejected: {exc}"))
        else:  # generate() ended without a finished output (it does not): end it anyway
            if self._live.get(rid) is live:
                self._finish(live, next_delta(live, [], "", "abort"))
        finally:
            if self.llm.errored and self.error is None and not self._stopped:
                self._died(self.llm.dead_error)

    def _abort(self, rid: str) -> None:
        live = self._live.get(rid)
        if live is not None and live.task is not None:
            live.task.cancel()

    def _abort_sink(self, sink: OutputSink) -> None:
        for rid, live in list(self._live.items()):
            if live.sink is sink:
                del self._live[rid]
                if live.task is not None:
                    live.task.cancel()

    def _deliver(self, live: LiveRequest, delta: GenerateDelta) -> None:
        if not live.sink.deliver(live.request_id, delta):
            self._abort(live.request_id)  # nobody listens any more
        self._touch(live.sink)

    def _finish(self, live: LiveRequest, delta: GenerateDelta) -> None:
        self._live.pop(live.request_id, None)
        live.sink.deliver(live.request_id, delta)
        self._touch(live.sink)

    def _deliver_to(self, sink: OutputSink, rid: str, item: BaseException) -> None:
        sink.deliver(rid, item)
        self._touch(sink)

    def _touch(self, sink: OutputSink) -> None:
        """One flush per sink after every request of this engine step has delivered."""
        self._touched.add(sink)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        touched, self._touched = self._touched, set()
        for sink in touched:
            try:
                sink.flush()
            except Exception:  # a sink's own failure must not stop the engine
                log.exception("output sink failed to flush")

    def _died(self, exc: BaseException, *, shutdown: bool = False) -> None:
        """vLLM's engine core is gone (or being shut down): fail every live request;
        ``error`` set (not on shutdown) makes the actor exit so Ray restarts it."""
        if self.error is None and not shutdown:
            log.error("vLLM engine died: %r", exc)
            self.error = exc
        for rid, live in list(self._live.items()):
            del self._live[rid]
            # vLLM does not say which request was in the step that failed: all may be.
            why = "the engine is shut down" if shutdown else f"vLLM engine failed: {exc!r}"
            err = EngineDeadError(why, suspect=not shutdown)
            self._deliver_to(live.sink, rid, err)
            if live.task is not None and live.task is not asyncio.current_task():
                live.task.cancel()
        self._loop.call_soon(self._failed.set)  # after the flush the deliveries scheduled
