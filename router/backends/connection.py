"""A front door's connection to a ``vllm serve`` it did not start: the data plane over
vLLM's own OpenAI HTTP API instead of kvroute's ZeroMQ one.

:class:`HttpReplicaConnection` has :class:`~.replica_connection.ReplicaConnection`'s
interface (``submit`` → :class:`~.replica_connection.InFlightRequest`, ``abort``,
``mark_lost``, ``check_silence``, ``close``, ``lost``, ``loads``, ``flights``), so admission,
routing, :class:`RequestRun`'s failover and resume, SSE and metrics run unchanged in front
of vLLM.

Why the shape:
- Each :class:`GenerateRequest` is one streamed ``POST /v1/completions`` whose prompt is
  token ids: the router tokenized and hashed exactly these tokens, so vLLM must not
  tokenize again (a chat template rendered twice, or a BOS added twice, would change the
  hashes). ``return_token_ids`` makes vLLM stream each chunk's token ids, which a failover
  resumes from; ``stream_options.include_usage`` brings the counts, and the cached tokens
  when the server runs with ``--enable-prompt-tokens-details``.
- A failover resume (:class:`Resume`) is a new request whose prompt is the prompt plus the
  tokens already streamed, ``max_tokens`` and ``min_tokens`` reduced by them: vLLM goes on
  as if it had made them (greedy output continues exactly; a seeded one draws afresh).
- Abort is closing the stream: vLLM aborts a request whose client disconnects.
- P/D (``kvroute router --prefill/--decode``): a ``kv_handoff`` request is the prefill half,
  one non-streamed ``POST`` with vLLM's ``kv_transfer_params`` (:mod:`.pd`); a request whose
  ``kv_source`` carries vLLM's params sends them with its body (the decode half).
- A backend whose stream breaks mid-response (its process died: the TCP connection
  closes) is lost whole, as a ZeroMQ connection that drops: every flight fails with
  :class:`ReplicaLostError`, the most recently sent one marked as the possible cause
  (:mod:`.quarantine`), so RequestRun fails the others over. A request that never reached
  it (connection refused) is nobody's cause. A backend that hangs without closing is
  found by the fleet's monitor (its ``/metrics`` stops answering): HTTP streams have no
  heartbeat, and a queued request streams nothing for as long as it waits.
- A pool of kept-alive connections per backend (:mod:`.http_wire`, not httpx: its
  per-chunk machinery was most of the front door's CPU per request); one connection per
  request in flight (HTTP/1.1 streams one response per connection). Each line of the
  stream is fed to the request's :class:`ChunkReader` inside the connection's
  ``data_received``, and its delta put in the flight there: no task wake-up per chunk. A
  stream is read to its end after ``[DONE]`` so that its connection can be reused.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgspec

from kvroute.events.replica_api import (
    JSON_OBJECT_SCHEMA,
    GenerateDelta,
    GenerateRequest,
    ReplicaDeadError,
    ReplicaLostError,
    next_delta,
)

from ..fleet.replica_connection import InFlightRequest, ReplicaConnectionBase
from .pd import run_prefill
from .wire import BackendPool, ConnectFailedError, StreamBrokenError

_FINISH = {"stop": "stop", "length": "length", "abort": "abort", "error": "error"}
TOKEN_ID_PREFIX = "token_id:"  # vLLM's logprob token names with return_tokens_as_token_ids


# -- vLLM's streamed chunks (only the fields read here) -------------------------------------
class _Logprobs(msgspec.Struct):
    top_logprobs: list[dict[str, float] | None] | None = None


class _Choice(msgspec.Struct):
    text: str = ""
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: _Logprobs | None = None


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: _Details | None = None


class _Error(msgspec.Struct):
    message: str = ""
    type: str = ""
    code: int | str | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = msgspec.field(default_factory=list)
    usage: _Usage | None = None
    error: _Error | None = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


class MalformedChunkError(ValueError):
    """A line of the backend's stream that is not one of vLLM's completion chunks."""


class ChunkReader:
    """One request's SSE stream from ``vllm serve`` as :class:`GenerateDelta` s.

    Feed it the stream's lines; it returns a delta when one is due. The finishing chunk is
    held until the usage chunk (or ``[DONE]``) that follows it, so the finished delta
    carries the counts and the cached tokens. ``done``: resumed tokens (they count as
    output), ``pending_text``: their text the client has not had yet (it goes first).

    ``text``: a resumed request's text, made here from its token ids
    (:class:`ResumeText`) in place of vLLM's: vLLM primes its detokenizer with the whole
    prompt, and a prompt that ends inside a UTF-8 character (a resume cut there) makes a
    later delta repeat the prompt's whole text."""

    def __init__(
        self,
        request_id: str,
        num_prompt: int,
        done: int = 0,
        pending_text: str = "",
        text: ResumeText | None = None,
    ) -> None:
        self.request_id = request_id
        self.num_prompt = num_prompt
        self.num_output = done
        self.pending_text = pending_text
        self.text = text
        self.finished = False  # ``[DONE]`` or an error seen: nothing more will come
        self._held: GenerateDelta | None = None  # the finishing delta, awaiting usage

    def feed(self, line: str) -> GenerateDelta | None:
        """The delta this line completes, if any. Raises :class:`MalformedChunkError`."""
        if not line.startswith("data:"):
            return None  # blank separators, comments, ``event:`` lines
        data = line[5:].strip()
        if data == "[DONE]":
            self.finished = True
            held, self._held = self._held, None
            if held is None:  # ended with no finish reason: say so rather than hang
                return next_delta(self, [], "", "error", error="the backend ended the stream early")
            return held
        try:
            chunk = _decode_chunk(data)
        except msgspec.DecodeError as exc:
            raise MalformedChunkError(f"not a completion chunk: {exc}") from None
        if chunk.error is not None:  # vLLM's error event mid-stream: this request failed
            self.finished = True
            self._held = None
            err = chunk.error
            delta = next_delta(self, [], "", "error", error=err.message or "backend error")
            if str(err.code).isdigit() and 400 <= int(str(err.code)) < 500:
                delta.failure = "invalid"  # vLLM refused it (e.g. a token out of vocabulary)
            return delta
        if chunk.usage is not None and self._held is not None and not chunk.choices:
            usage = chunk.usage
            details = usage.prompt_tokens_details
            if details is not None and details.cached_tokens:
                self._held.num_cached_tokens = min(details.cached_tokens, self.num_prompt)
            return None  # delivered at [DONE]: nothing follows it but that
        if not chunk.choices:
            return None
        c = chunk.choices[0]
        ids = list(c.token_ids or ())
        if self.text is not None:
            c.text = self.text.step(ids, c.finish_reason is not None)
        reason = None
        if c.finish_reason is not None:
            reason = _FINISH.get(c.finish_reason, "stop")  # "repetition" ends as a stop
        delta = next_delta(self, ids, c.text, reason)
        if c.logprobs is not None and c.logprobs.top_logprobs is not None:
            delta.logprobs = [_logprob_ids(d or {}) for d in c.logprobs.top_logprobs]
        if reason is None:
            return delta
        delta.stop_reason = c.stop_reason
        self._held = delta
        return None


def _logprob_ids(top: dict[str, float]) -> dict[int, float]:
    """``{"token_id:123": lp}`` (vLLM's ``return_tokens_as_token_ids``) as ``{123: lp}``."""
    out: dict[int, float] = {}
    for name, lp in top.items():
        if name.startswith(TOKEN_ID_PREFIX):
            out[int(name[len(TOKEN_ID_PREFIX) :])] = float(lp)
    return out


class ResumeText:
    """A resumed request's text from its token ids, incrementally (a window of a few
    tokens decoded per step, as vLLM's and TGI's slow detokenizers do): text goes out only
    once its characters are whole; bytes of a character the request ends inside are
    dropped, as vLLM drops them."""

    def __init__(self, decode: Callable[[list[int]], str], made: list[int], sent: int) -> None:
        """``made``: the tokens streamed before the failover; ``sent``: how many characters
        of their text the client has (the rest goes out with the first step)."""
        self.decode = decode
        self.ids = list(made)
        read = len(made)  # back off to a whole character: the rest is decoded with the next
        while read > 0 and read > len(made) - 4 and decode(made[:read]).endswith("\ufffd"):
            read -= 1
        self.pending = decode(made[:read])[sent:]
        self.read = read
        self.prefix = max(read - 6, 0)

    def step(self, ids: list[int], last: bool) -> str:
        self.ids += ids
        before = self.decode(self.ids[self.prefix : self.read])
        after = self.decode(self.ids[self.prefix :])
        if last:  # as vLLM: a request that ends inside a character ends before it
            after = after.rstrip("\ufffd")
        out = ""
        if len(after) > len(before) and not after.endswith("\ufffd"):
            out = after[len(before) :]
            self.prefix, self.read = self.read, len(self.ids)
        if self.pending:
            out, self.pending = self.pending + out, ""
        return out


def completion_body(req: GenerateRequest, model: str) -> dict[str, Any] | None:
    """The ``/v1/completions`` body that runs ``req`` on vLLM; None: a resume with nothing
    left to make (``max_tokens`` already reached)."""
    s = req.sampling
    prompt = list(req.prompt_token_ids)
    done = 0
    if req.resume is not None:
        done = len(req.resume.output_token_ids)
        prompt += req.resume.output_token_ids
    left = s.max_tokens - done
    if left <= 0:
        return None
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": left,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        "request_id": req.request_id,
    }
    if s.top_k > 0:
        body["top_k"] = s.top_k
    if s.min_p > 0:
        body["min_p"] = s.min_p
    if s.seed is not None:
        body["seed"] = s.seed
    if s.stop:
        body["stop"] = list(s.stop)
    if s.stop_token_ids:
        body["stop_token_ids"] = list(s.stop_token_ids)
    if s.ignore_eos:
        body["ignore_eos"] = True
    if s.min_tokens - done > 0:
        body["min_tokens"] = s.min_tokens - done
    if s.logprobs is not None:
        body["logprobs"] = s.logprobs
        body["return_tokens_as_token_ids"] = True
    # As with a vLLM replica, a resume's earlier tokens are prompt to vLLM: they count for
    # the repetition penalty only.
    if s.presence_penalty:
        body["presence_penalty"] = s.presence_penalty
    if s.frequency_penalty:
        body["frequency_penalty"] = s.frequency_penalty
    if s.repetition_penalty != 1.0:
        body["repetition_penalty"] = s.repetition_penalty
    if s.logit_bias:
        body["logit_bias"] = {str(t): b for t, b in s.logit_bias.items()}
    so = s.structured_outputs
    if so is not None:  # vLLM's own fields; any JSON object as kvroute's engine compiles it
        fields = msgspec.structs.asdict(so)
        if fields.pop("json_object"):
            fields["json"] = JSON_OBJECT_SCHEMA
        body["structured_outputs"] = {k: v for k, v in fields.items() if v not in (None, False)}
    if req.cache_salt:  # vLLM wants 1 to 1024 characters, or none
        body["cache_salt"] = req.cache_salt
    src = req.kv_source
    if src is not None and src.kv_transfer_params:  # the decode half of a P/D pair (.pd)
        body["kv_transfer_params"] = src.kv_transfer_params
    return body


_conn_ids = itertools.count()


class HttpReplicaConnection(ReplicaConnectionBase):
    """One ``vllm serve`` as a replica connection; used from one event loop only. Lost
    (:meth:`~ReplicaConnectionBase.mark_lost`), it closes every stream."""

    lost_noun = "backend"

    def __init__(
        self,
        replica_id: str,
        base_url: str,
        incarnation: str,
        model: str,
        on_lost: Callable[[str, str], None],
        decode: Callable[[list[int]], str] | None = None,
    ) -> None:
        """``model``: the backend's served model name; ``decode``: token ids to text (a
        resume's text held back from the client goes first in its new stream)."""
        self.replica_id = replica_id
        self.endpoint = base_url.rstrip("/")
        self.incarnation = incarnation
        self.model = model
        self.on_lost = on_lost
        self.decode = decode
        self.loads = 0  # nothing pushes load over HTTP: the fleet polls /metrics instead
        self.lost: str | None = None
        self.flights: dict[str, InFlightRequest] = {}
        self.malformed = 0
        self.last_heard = time.monotonic()
        self._seq = itertools.count()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._loop = asyncio.get_running_loop()
        self.pool = BackendPool(self.endpoint)
        self.id = next(_conn_ids)
        self.pd_counts: Counter[str] = Counter()  # P/D prefill halves run, fallen back (.pd)

    # -- requests ----------------------------------------------------------------------------
    def submit(self, req: GenerateRequest) -> InFlightRequest:
        """Starts the request's stream; its deltas arrive in the returned flight."""
        flight = InFlightRequest(req.request_id, next(self._seq))
        if self.lost is not None:
            flight.fail(ReplicaLostError(f"replica {self.replica_id}: {self.lost}"))
            return flight
        body = completion_body(req, self.model)
        reader = self._reader(req)
        why = None
        if req.sampling.prompt_logprobs is not None:  # vLLM refuses them in a stream
            why = "`echo` with `logprobs` is not available from a fronted vllm serve"
        elif req.sampling.structured_outputs and req.resume and req.resume.output_token_ids:
            why = "a structured output cannot be resumed on a fronted vllm serve"
        if why is not None:
            delta = next_delta(reader, [], "", "error", error=why)
            delta.failure = "invalid"
            flight.put(delta)
            return flight
        if body is None:  # a resume that already made max_tokens: it ends here
            flight.put(next_delta(reader, [], "", "length"))
            return flight
        self.flights[req.request_id] = flight
        if req.kv_handoff:  # the prefill half of a P/D pair: vLLM's kv_transfer_params
            run = run_prefill(self, body, flight, len(req.prompt_token_ids))
        else:
            run = self._run(body, reader, flight)
        task = self._loop.create_task(run)
        self._tasks[req.request_id] = task
        return flight

    def _reader(self, req: GenerateRequest) -> ChunkReader:
        resume, decode = req.resume, self.decode
        if resume is None or not resume.output_token_ids or decode is None:
            done = len(resume.output_token_ids) if resume is not None else 0
            return ChunkReader(req.request_id, len(req.prompt_token_ids), done)
        made = list(resume.output_token_ids)
        if req.sampling.stop:  # vLLM holds text back for stop strings: its own text, then
            pending = decode(made)[resume.sent_chars :]
            return ChunkReader(req.request_id, len(req.prompt_token_ids), len(made), pending)
        text = ResumeText(decode, made, resume.sent_chars)
        return ChunkReader(req.request_id, len(req.prompt_token_ids), len(made), "", text)

    def abort(self, request_id: str) -> None:
        """Ends the request: its stream is closed, so vLLM aborts it."""
        self.flights.pop(request_id, None)
        task = self._tasks.pop(request_id, None)
        if task is not None:
            task.cancel()

    async def _run(
        self, body: dict[str, Any], reader: ChunkReader, flight: InFlightRequest
    ) -> None:
        rid = flight.request_id
        raw = _encode(body)
        data = self.pool.head("POST", "/v1/completions", len(raw)) + raw
        stream = _Stream(self, reader, flight)
        try:
            try:
                # Given up on mid-stream (aborted: this task cancelled), the connection is
                # closed, so vLLM aborts the request.
                _, status, refused = await self.pool.send(data, stream.line, stream.sending)
            except ConnectFailedError as exc:
                # Never reached it: not this request's doing; the backend is gone.
                why = f"replica {self.replica_id}: unreachable ({exc})"
                self._end(flight, ReplicaLostError(why))
                self.mark_lost("unreachable (ConnectError)")
                return
            if status != 200:
                self._refused(flight, status, refused)
            elif not stream.ended and not reader.finished:
                # The response ended without [DONE]: the backend cut it short.
                self.mark_lost("its response ended early")
        except StreamBrokenError as exc:  # its connection broke mid-response: it died
            if not stream.ended:
                self.mark_lost(f"its stream broke ({exc})")
        finally:
            if self._tasks.get(rid) is asyncio.current_task():
                del self._tasks[rid]

    def _refused(self, flight: InFlightRequest, status: int, raw: bytes) -> None:
        """A non-200 answer: a 4xx is the request's fault (vLLM's message), a 5xx the
        backend's (it failed this request; the monitor decides whether it is gone)."""
        try:
            msg = msgspec.json.decode(raw).get("error", {}).get("message") or ""
        except (msgspec.DecodeError, AttributeError):
            msg = raw[:200].decode(errors="replace")
        if 400 <= status < 500:
            delta = GenerateDelta(
                request_id=flight.request_id,
                delta_token_ids=[],
                finished=True,
                finish_reason="error",
                error=msg or f"HTTP {status}",
                failure="invalid",
            )
            self.flights.pop(flight.request_id, None)
            flight.put(delta)
        else:
            self._end(flight, ReplicaDeadError(f"replica {self.replica_id}: HTTP {status} {msg}"))

    def _end(self, flight: InFlightRequest, exc: BaseException) -> None:
        self.flights.pop(flight.request_id, None)
        flight.fail(exc)

    # -- liveness ----------------------------------------------------------------------------
    def silence_due_in(self, now: float) -> float:
        """Never: see :meth:`check_silence`."""
        return float("inf")

    def check_silence(self, now: float) -> None:
        """Nothing to check: an HTTP stream has no heartbeat, and a request waiting in
        vLLM's queue streams nothing. A hung backend is the monitor's (its /metrics)."""

    def close(self) -> None:
        """Closes every stream and connection."""
        tasks = list(self._tasks.values())
        self._tasks.clear()
        current = asyncio.current_task() if self._loop.is_running() else None
        for task in tasks:
            if task is not current:
                task.cancel()
        self.pool.close()


_encode = msgspec.json.Encoder().encode


class _Stream:
    """One response's lines into its reader, and the deltas into its flight; called from
    the connection's ``data_received`` (:mod:`.http_wire`), so a chunk costs no task
    wake-up. ``ended``: the request is settled (``[DONE]``, an error event, a malformed
    line): nothing the connection does after it concerns the request."""

    __slots__ = ("conn", "ended", "first", "flight", "reader", "sent")

    def __init__(
        self, conn: HttpReplicaConnection, reader: ChunkReader, flight: InFlightRequest
    ) -> None:
        self.conn = conn
        self.reader = reader
        self.flight = flight
        self.sent = 0.0
        self.first = True
        self.ended = False

    def sending(self, _conn: object) -> None:
        """The request goes out (again, if a stale connection had to be replaced)."""
        self.sent = time.perf_counter()

    def line(self, raw: bytes) -> bool | None:
        """False: stop reading (the connection is closed)."""
        if self.ended or not raw:
            return None  # after [DONE] the body's end is awaited only to reuse the connection
        conn = self.conn
        conn.last_heard = time.monotonic()
        try:
            delta = self.reader.feed(raw.decode())
        except (MalformedChunkError, UnicodeDecodeError) as exc:
            conn.malformed += 1
            self.ended = True
            conn._end(self.flight, ReplicaDeadError(f"replica {conn.replica_id}: {exc}"))
            return False
        if delta is not None:
            if self.first and (delta.delta_token_ids or delta.finished):
                self.first = False
                delta.replica_ttft_s = time.perf_counter() - self.sent
            if delta.finished:
                conn.flights.pop(self.flight.request_id, None)
            self.flight.put(delta)
        if self.reader.finished:
            self.ended = True
        return None
