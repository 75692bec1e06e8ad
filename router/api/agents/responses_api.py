"""``POST /v1/responses``: OpenAI's Responses API (stateless), as vLLM serves it.

Why its own writer over the chat's intake: the request is a chat (:mod:`.responses_input`
translates it; the run is routed and sent by :mod:`.intake` as any chat's), but the
answer's shape is the Responses API's: a ``response`` object whose ``output`` lists items
-- a ``message`` with ``output_text``, a ``function_call`` per call -- and, streamed, typed
events (``response.created``, ``response.output_item.added``,
``response.output_text.delta``, ``response.function_call_arguments.delta``, ...,
``response.completed``), each with its ``sequence_number``, with no ``[DONE]``. The text
is read by the chat's tool plan (:class:`~.tools.ToolStream`), so calls and content come
out as they do in a chat. An answer cut by ``max_output_tokens`` is ``incomplete``.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pydantic
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ...fleet.request_run import RequestRun
from ...fleet.tenants import Tenant
from ..errors import (
    APIError,
    new_id,
    read_body,
    request_failed,
    request_id,
    stream_failure,
    validation_error,
)
from ..intake import Intake
from ..metrics import end_request
from ..openai_api import ChatCompletionRequest
from ..priority import read_hints
from ..responses import (
    REPLICA_HEADER,
    Collected,
    ResponseContext,
    await_first_delta,
    collect_whole,
    first_or_gone,
)
from ..sse import Emit, SSEResponse, encode_json
from .responses_input import ChatForm, ResponsesRequest, responses_param, to_chat
from .tools import ToolPlan, ToolStream


async def create_response(request: Request, tenant: Tenant) -> Response:
    """The handler: the chat's intake, which admits the request, then reads it (read and
    translated here: a refused request is never read), then the answer."""
    arrival = time.perf_counter()
    state = request.app.state
    rid = request_id(request)
    intake: Intake = state.intake
    read: list[tuple[ResponsesRequest, ChatForm]] = []

    async def chat_body() -> bytes:
        raw = await read_body(request, state.max_body_bytes, state.body_timeout_s)
        try:
            body = ResponsesRequest.model_validate_json(raw)
        except pydantic.ValidationError as exc:
            raise validation_error(list(exc.errors(include_url=False))) from None
        form = to_chat(body, json.loads(raw))
        read.append((body, form))
        return json.dumps(form.chat).encode()

    try:
        hints = read_hints(request.scope, getattr(state, "priority_header", None))
        admitted = await intake.begin(tenant, ChatCompletionRequest, chat_body, rid, hints)
    except APIError as exc:
        if read:  # the chat's field names, as the Responses fields they came from
            exc.param = responses_param(exc.param)
        raise
    [(body, form)] = read
    run, plan = admitted.runs[0], admitted.tools
    shape = Shape(body, form, admitted.body.model, plan)
    ctx: ResponseContext = state.responses
    try:
        if body.stream:
            return _stream(ctx, rid, run, shape, arrival)
        return await _whole(ctx, request, rid, run, shape, arrival)
    except BaseException:
        run.close()
        raise


class Shape:
    """One answer's ``response`` object, items and usage, in the Responses API's shape."""

    def __init__(self, body: ResponsesRequest, form: ChatForm, model: str, plan: ToolPlan | None):
        self.id = f"resp_{new_id()}"
        self.created = int(time.time())
        self.body, self.form, self.model, self.plan = body, form, model, plan
        self.output: list[dict[str, Any]] = []
        self.usage: dict[str, Any] | None = None

    def response(self, status: str, finish: str | None = None) -> dict[str, Any]:
        b = self.body
        incomplete = {"reason": "max_output_tokens"} if finish == "length" else None
        return {
            "id": self.id, "object": "response", "created_at": self.created,
            "status": "incomplete" if incomplete and status == "completed" else status,
            "incomplete_details": incomplete, "error": None, "model": self.model,
            "instructions": b.instructions, "output": self.output,
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "tool_choice": b.tool_choice if b.tool_choice is not None else "auto",
            "tools": self.form.tools, "temperature": b.temperature, "top_p": b.top_p,
            "max_output_tokens": b.max_output_tokens, "previous_response_id": None,
            "reasoning": None, "store": False, "truncation": "disabled",
            "text": {"format": self.form.text_format}, "metadata": b.metadata or {},
            "usage": self.usage, "user": None,
        }  # fmt: skip

    def set_usage(self, last: Any) -> None:
        prompt, output = last.num_prompt_tokens, last.num_output_tokens
        self.usage = {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": last.num_cached_tokens},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + output,
        }

    @staticmethod
    def message(text: str, status: str = "completed") -> dict[str, Any]:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return {"type": "message", "id": f"msg_{new_id()}", "status": status,
                "role": "assistant", "content": [part]}  # fmt: skip

    @staticmethod
    def call(call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
        return {"type": "function_call", "id": f"fc_{new_id()}", "call_id": call_id,
                "name": name, "arguments": arguments, "status": status}  # fmt: skip


async def _whole(
    ctx: ResponseContext, request: Request, rid: str, run: RequestRun, shape: Shape,
    arrival: float,
) -> Response:  # fmt: skip
    if run.waiting:  # at the door (flow control): a client that leaves takes it out
        if not await first_or_gone(ctx, request, run, rid, None):
            return Response(status_code=499)
    else:
        await await_first_delta(run, rid)
    ttft_s = time.perf_counter() - arrival
    got = Collected()
    gone = await collect_whole(ctx, request, rid, run, got, ttft_s, arrival)
    if gone is not None:
        return gone
    last = got.last
    if last is None or last.finish_reason == "error":
        end_request(ctx.metrics, rid, run, last, ttft_s, "500 request_failed", arrival)
        raise request_failed(rid, last)
    end_request(ctx.metrics, rid, run, last, ttft_s, f"200 {last.finish_reason}", arrival)
    plan = shape.plan
    text, calls = (got.text(), []) if plan is None else plan.read(got.tool_text(plan))
    if text or not calls:
        shape.output.append(Shape.message(text or ""))
    shape.output += [Shape.call(plan.call_id(), c.name, c.arguments) for c in calls]  # type: ignore[union-attr]
    shape.set_usage(last)
    return JSONResponse(shape.response("completed", last.finish_reason),
                        headers={REPLICA_HEADER: run.replica})  # fmt: skip


def _stream(
    ctx: ResponseContext, rid: str, run: RequestRun, shape: Shape, arrival: float
) -> Response:
    timing: dict[str, float] = {}

    async def ready() -> None:
        try:
            await await_first_delta(run, rid)
        except asyncio.CancelledError:
            ctx.errors["client_gone"] += 1
            end_request(ctx.metrics, rid, run, None, None, "499 client_gone", arrival)
            raise
        timing["ttft_s"] = time.perf_counter() - arrival

    async def write(emit: Emit) -> None:
        await _events(ctx, rid, run, shape, Events(emit), arrival, timing.get("ttft_s"))

    return SSEResponse(write, lambda: {REPLICA_HEADER: run.replica}, ctx.send_timeout_s,
                       on_close=run.close, ready=ready)  # fmt: skip


class Events:
    """Typed SSE events, numbered, and the open output items they build."""

    def __init__(self, emit: Emit) -> None:
        self.emit = emit
        self.seq = 0
        self.out: list[bytes] = []
        self.text_item: dict[str, Any] | None = None
        self.text_index = 0
        self.text = ""
        self.calls: dict[int, dict[str, Any]] = {}  # tool call index -> its item

    def add(self, kind: str, **fields: Any) -> None:
        data = encode_json({"type": kind, "sequence_number": self.seq, **fields})
        self.seq += 1
        self.out.append(b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n")

    async def flush(self, last: bool = False) -> None:
        if self.out or last:
            data, self.out = b"".join(self.out), []
            await self.emit(data, last)

    def item_added(self, shape: Shape, item: dict[str, Any]) -> int:
        shape.output.append(item)
        self.add("response.output_item.added", output_index=len(shape.output) - 1, item=item)
        return len(shape.output) - 1

    def delta(self, shape: Shape, d: dict[str, Any]) -> None:
        """One chat delta (:class:`~.tools.ToolStream`'s) as the Responses API's events."""
        if d.get("content"):
            if self.text_item is None:
                self.text_item = Shape.message("", "in_progress")
                self.text_index = self.item_added(shape, self.text_item)
                part = self.text_item["content"][0]
                self.add("response.content_part.added", item_id=self.text_item["id"],
                         output_index=self.text_index, content_index=0, part=part)  # fmt: skip
            self.text += d["content"]
            self.add("response.output_text.delta", item_id=self.text_item["id"],
                     output_index=self.text_index, content_index=0, delta=d["content"],
                     logprobs=[])  # fmt: skip
        for piece in d.get("tool_calls") or ():
            fn = piece.get("function") or {}
            item = self.calls.get(piece["index"])
            if item is None:
                self.close_text(shape)
                item = Shape.call(piece["id"], fn.get("name") or "", "", "in_progress")
                item["output_index"] = self.item_added(shape, item)
                self.calls[piece["index"]] = item
            if fn.get("arguments"):
                item["arguments"] += fn["arguments"]
                self.add("response.function_call_arguments.delta", item_id=item["id"],
                         output_index=item["output_index"], delta=fn["arguments"])  # fmt: skip

    def close_text(self, shape: Shape) -> None:
        item = self.text_item
        if item is None or item["status"] == "completed":
            return
        at = self.text_index
        part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
        item.update(status="completed", content=[part])
        self.add("response.output_text.done", item_id=item["id"], output_index=at,
                 content_index=0, text=self.text, logprobs=[])  # fmt: skip
        self.add("response.content_part.done", item_id=item["id"], output_index=at,
                 content_index=0, part=part)  # fmt: skip
        self.add("response.output_item.done", output_index=at, item=item)

    def close_calls(self) -> None:
        for item in self.calls.values():
            at = item.pop("output_index")
            item["status"] = "completed"
            self.add("response.function_call_arguments.done", item_id=item["id"],
                     output_index=at, name=item["name"], arguments=item["arguments"])  # fmt: skip
            self.add("response.output_item.done", output_index=at, item=item)


async def _events(
    ctx: ResponseContext, rid: str, run: RequestRun, shape: Shape, ev: Events, arrival: float,
    ttft_s: float | None,
) -> None:  # fmt: skip
    shapes = ToolStream(shape.plan) if shape.plan is not None else None
    last, status = None, "200"
    ev.add("response.created", response=shape.response("in_progress"))
    ev.add("response.in_progress", response=shape.response("in_progress"))
    try:
        d = run.first
        while d is not None:
            last = d
            if d.finish_reason == "error":
                status = "500 request_failed (in stream)"
                err = request_failed(rid, d)
                ev.add("error", code=err.code, message=err.message, param=None)
                break
            if shapes is None:
                deltas = [{"content": d.delta_text}]
            else:
                deltas = shapes.feed(d.delta_text, d.delta_token_ids)
                if d.finished:
                    deltas += shapes.finish(d.finish_reason)[0]
            for delta in deltas:
                ev.delta(shape, delta)
            if d.finished:
                break
            await ev.flush()
            d = await run.next()
        if status == "200" and last is not None and last.finished:
            ev.close_text(shape)
            ev.close_calls()
            if not shape.output:  # nothing said: an empty message, as a whole answer has
                shape.output.append(Shape.message(""))
            shape.set_usage(last)
            final = shape.response("completed", last.finish_reason)
            kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
            ev.add(kind, response=final)
    except Exception as exc:  # never a silently cut stream: say so
        failure = stream_failure(ctx, rid, exc)
        status = failure.status
        ev.add("error", code=failure.code, message=failure.message, param=None)
    finally:
        run.close()
        if status == "200":
            status = f"200 {last.finish_reason}" if last and last.finished else "499 client_gone"
        end_request(ctx.metrics, rid, run, last, ttft_s, status, arrival)
    await ev.flush(last=True)
