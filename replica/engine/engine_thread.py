"""The engine thread of :class:`~.async_engine.AsyncLLMEngine`: its commands and its loop.

Split out of :mod:`.async_engine` so that file holds what callers on other threads use
(submit, abort, ``call``, ``generate``, shutdown) and this one what only the engine thread
runs: draining the command queue between steps, stepping the engine, handing each output
to its request's sink and flushing the sinks a step touched, and failing every request
when a step raises. The thread owns the engine; nothing here is called from another
thread. ``EngineThread`` is a mixin of ``AsyncLLMEngine`` (its attributes).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvroute.events.load import LoadReport
from kvroute.events.transport.threads import name_native_thread

from ..core.outputs import EngineOutput
from .replica_engine import EngineDeadError, OutputSink, Submission

if TYPE_CHECKING:
    from .llm_engine import LLMEngine

log = logging.getLogger("kvroute.replica.engine.async_engine")  # the engine's log, as before

LOAD_REFRESH_S = 0.02  # the engine's load report is at most this stale between commands


@dataclass(slots=True)
class Abort:
    request_id: str


@dataclass(slots=True)
class AbortSink:
    """Every request of one sink (a front door that has gone)."""

    sink: OutputSink


@dataclass(slots=True)
class Call:
    fn: Callable[[LLMEngine], Any]
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop


# Wakes an idle engine thread for one look at its leases (a prefix fetch waits on a pin).
WAKE = object()


class EngineThread:
    """:class:`~.async_engine.AsyncLLMEngine`'s engine-thread methods (its attributes)."""

    llm_engine: LLMEngine
    _commands: queue.SimpleQueue[Submission | Abort | AbortSink | Call | object]
    _sinks: dict[str, OutputSink]
    _touched: set[OutputSink]
    _event_sinks: list[Callable[[list[Any]], Any]]
    _events: list[list[Any]]
    error: BaseException | None
    _failed: threading.Event
    _injected_failure: str | None
    load: LoadReport

    def _run(self) -> None:
        name_native_thread()
        engine = self.llm_engine
        scheduler = engine.scheduler
        load_at = time.monotonic()
        try:
            while True:
                # Block only when there is nothing to compute.
                applied = self._drain(block=not scheduler.has_unfinished_requests())
                if applied is None:
                    self._fail_all(EngineDeadError("the engine is shut down"))
                    self._close_engine()
                    return
                # The load changes only by a command or a step. It is read every 0.1 s at
                # most (the data plane's push, Ray polls), and a report walks every waiting
                # request's prefix: remade after commands (before the step, which may be a
                # long prefill) and after a step that ended a request, otherwise once it
                # is LOAD_REFRESH_S old (decode steps come faster).
                if applied:
                    self.load, load_at = scheduler.load_report(), time.monotonic()
                ended = False
                if scheduler.has_unfinished_requests():
                    if self._injected_failure is not None:
                        raise RuntimeError(self._injected_failure)
                    for out in engine.step():
                        ended |= out.finished
                        self._deliver(out.request_id, out, last=out.finished)
                    now = time.monotonic()
                    if ended or now - load_at >= LOAD_REFRESH_S:
                        self.load, load_at = scheduler.load_report(), now
                elif scheduler.leases is not None:  # idle (no step): a lease released by
                    scheduler.leases.poll()  # its puller, or expired, frees its blocks now
                self._flush()
        except BaseException as exc:
            batch = engine.current_batch  # None: it failed before the batch was known
            log.exception("engine step failed (batch: %s)", "unknown" if batch is None else batch)
            self.error = exc
            for rid in list(self._sinks):
                suspect = batch is None or rid in batch
                err = EngineDeadError(f"engine step failed: {exc!r}", suspect=suspect)
                self._deliver(rid, err, last=True)
            self._fail_queued(EngineDeadError(f"engine step failed: {exc!r}"))
            self._flush()
            self._close_engine()
            self._failed.set()

    def _close_engine(self) -> None:
        """The engine thread's last act: the engine's threads stop and its KV disk folder
        (tenants' data) is removed. Its own failure is logged, never raised."""
        try:
            self.llm_engine.close()
        except Exception:
            log.exception("closing the engine failed")

    def _flush(self) -> None:
        touched = self._touched
        while touched:
            sink = touched.pop()
            try:
                sink.flush()
            except Exception:  # a sink's own failure must not stop the engine
                log.exception("output sink failed to flush")
        if self._events:  # the engine appends to this very list (its only event sink)
            batches = self._events.copy()
            self._events.clear()
            for events in batches:
                for publish in self._event_sinks:
                    try:
                        publish(events)
                    except Exception:
                        log.exception("event sink failed")

    def _fail_all(self, err: EngineDeadError) -> None:
        """On shutdown: free every live request's blocks and end its stream with ``err``."""
        live = list(self._sinks)
        self.llm_engine.abort_requests(live)
        for rid in live:
            self._deliver(rid, err, last=True)
        self._fail_queued(err)
        self._flush()

    def _fail_queued(self, err: EngineDeadError) -> None:
        """Requests still in the command queue will never run: their callers must not wait."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, Submission):
                cmd.sink.deliver(cmd.request_id, err)
                self._touched.add(cmd.sink)
            elif isinstance(cmd, Call):
                resolve_call(cmd, err)

    def _drain(self, block: bool) -> int | None:
        """Applies queued commands; how many (None: asked to stop). Looks before it takes
        when not blocking: most steps find the queue empty, and an Empty raised costs more."""
        commands, applied = self._commands, 0
        while block or not commands.empty():
            try:
                cmd = commands.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return applied
            block = False
            if cmd is WAKE:  # a prefix fetch's pin waits for the next lease poll
                continue
            applied += 1
            if cmd is None:
                return None
            if isinstance(cmd, Abort):
                for out in self.llm_engine.abort_requests([cmd.request_id]):
                    self._deliver(out.request_id, out, last=True)
                continue
            if isinstance(cmd, AbortSink):
                mine = [rid for rid, sink in self._sinks.items() if sink is cmd.sink]
                for rid in mine:  # nobody reads them: no outputs, just free the blocks
                    del self._sinks[rid]
                self.llm_engine.abort_requests(mine)
                continue
            if isinstance(cmd, Call):
                try:
                    result = cmd.fn(self.llm_engine)
                except Exception as exc:
                    resolve_call(cmd, exc)
                else:
                    resolve_call(cmd, result, ok=True)
                continue
            if cmd.request_id in self._sinks:
                # The id is live: refuse the newcomer without touching the owner's stream.
                err = ValueError(f"request id {cmd.request_id!r} is already in use")
                cmd.sink.deliver(cmd.request_id, err)
                self._touched.add(cmd.sink)
                continue
            self._sinks[cmd.request_id] = cmd.sink
            try:
                self.llm_engine.add_request(
                    cmd.request_id,
                    cmd.prompt,
                    cmd.params,
                    cache_salt=cmd.cache_salt,
                    lora_name=cmd.lora_name,
                    resume=cmd.resume,
                    tenant=cmd.tenant,
                    deltas=cmd.sink.deltas,
                    kv_handoff=cmd.kv_handoff,
                    kv_source=cmd.kv_source,
                    priority=cmd.priority,
                )
            except Exception as exc:  # a bad request fails alone
                self._deliver(cmd.request_id, exc, last=True)
        return applied

    def _deliver(self, rid: str, item: EngineOutput | BaseException, last: bool) -> None:
        sink = self._sinks.pop(rid, None) if last else self._sinks.get(rid)
        if sink is None:
            return
        self._touched.add(sink)
        if not sink.deliver(rid, item) and not last:
            self._commands.put(Abort(rid))  # nobody is listening any more


def resolve_call(call: Call, value: Any, ok: bool = False) -> None:
    """Completes a :meth:`AsyncLLMEngine.call` future from the engine thread."""

    def settle() -> None:
        if call.future.done():  # the caller gave up (cancelled)
            return
        if ok:
            call.future.set_result(value)
        else:
            call.future.set_exception(value)

    try:
        call.loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the caller's loop is closed
        pass
