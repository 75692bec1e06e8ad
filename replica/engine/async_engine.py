"""AsyncLLMEngine: the engine on its own thread; requests in by a command queue, outputs out
through sinks.

Why a thread and not an event loop: a model step holds the CPU/GPU for milliseconds to
seconds, and torch releases the GIL inside it, so I/O (the data plane's sockets, an asyncio
caller) goes on while the engine computes. The thread owns the engine outright; callers talk
to it through a command queue. Each request names an :class:`OutputSink`; after every step
the thread hands each output to its request's sink, then calls ``flush`` once on every sink
it touched -- so a sink that batches (the data plane: one message per front door per step)
sees the step's end. :meth:`AsyncLLMEngine.generate` is the asyncio sink, for in-process use.

A caller that stops iterating (client gone, task cancelled) aborts its request, which frees
its blocks before the next step. If a step raises, every live request gets the error and the
engine refuses new work (``errored``): a replica actor should then exit so Ray restarts it.
A fault of one request's own (its seed, its text, its stop strings) does not get here: the
engine ends that request with ``finish_reason="error"`` and steps on.

What runs on the engine thread itself (the command queue's commands, draining them, the
step loop, delivery to sinks, failing every request) is :mod:`.engine_thread`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import queue
import sys
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

from kvroute.events.load import LoadReport
from kvroute.events.replica_api import Resume, SamplingParams

from ..core.outputs import EngineOutput, RequestOutput
from .engine_thread import WAKE, Abort, AbortSink, Call, EngineThread
from .llm_engine import EngineConfig, EventSink, LLMEngine
from .replica_engine import EngineDeadError, EngineFacts, OutputSink, ReplicaEngine, Submission

__all__ = ["AsyncLLMEngine", "EngineDeadError", "OutputSink"]

T = TypeVar("T")


class _QueueSink:
    """An asyncio caller's queue, fed across threads."""

    __slots__ = ("loop", "queue")
    deltas = False

    def __init__(self, queue: asyncio.Queue[Any], loop: asyncio.AbstractEventLoop) -> None:
        self.queue, self.loop = queue, loop

    def deliver(self, request_id: str, item: EngineOutput | BaseException) -> bool:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed
            return False
        return True

    def flush(self) -> None:
        pass


class AsyncLLMEngine(EngineThread, ReplicaEngine):
    """Thread-hosted :class:`LLMEngine` with an async streaming ``generate``; a replica's
    :class:`~.replica_engine.ReplicaEngine` (``llm_engine`` is the engine it hosts)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.llm_engine = engine
        self._commands: queue.SimpleQueue[Submission | Abort | AbortSink | Call | object] = (
            queue.SimpleQueue()
        )
        if engine.scheduler.leases is not None:
            engine.scheduler.leases.wake = lambda: self._commands.put(WAKE)
        self._sinks: dict[str, OutputSink] = {}
        self._touched: set[OutputSink] = set()  # sinks delivered to since the last flush
        # A step's KV events leave right after its outputs, not in the middle of the step:
        # back to back, the two sends share one wake-up of ZeroMQ's I/O thread here and
        # of each front door's event loop there, where apart they would cost one each.
        self._event_sinks = list(engine.event_sinks)
        self._events: list[list[Any]] = []  # batches the engine made since the last flush
        engine.event_sinks[:] = [self._events.append]
        self._ids = itertools.count()
        self.error: BaseException | None = None
        self._failed = threading.Event()  # set once a failure has reached every request
        self._stopped = False
        self._injected_failure: str | None = None  # see inject_failure
        # The scheduler's load after the engine thread's latest step or intake: readable from
        # any thread at once, where a call() would wait for a step to end (a long prefill).
        self.load: LoadReport = engine.scheduler.load_report()
        # Requests whose new structured-output constraint compiles on a worker thread first
        # (see submit); an abort meanwhile drops them there.
        self._compiling: dict[str, Submission] = {}
        self._compiling_lock = threading.Lock()
        self._compile_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._thread = threading.Thread(target=self._run, name="kvr-engine", daemon=True)
        self._thread.start()

    @property
    def thread_alive(self) -> bool:
        """Whether the engine thread still runs (it ends at shutdown or on a failure)."""
        return self._thread.is_alive()

    @property
    def num_compiling(self) -> int:
        """Requests whose structured-output constraint is still compiling, not yet added."""
        with self._compiling_lock:
            return len(self._compiling)

    @classmethod
    def from_config(
        cls, config: EngineConfig, event_sinks: Sequence[EventSink] = ()
    ) -> AsyncLLMEngine:
        return cls(LLMEngine(config, event_sinks))

    @property
    def errored(self) -> bool:
        return self.error is not None

    def describe(self) -> EngineFacts:
        engine = self.llm_engine
        hc = engine.hash_config
        return EngineFacts(
            model_path=engine.model_path,
            hash_algo=hc.algo,
            hash_seed=hc.seed,
            hash_form=engine.config.hash_form,
            block_size=hc.block_size,
            num_blocks=engine.runner.num_blocks,
            max_model_len=engine.max_model_len,
            vocab_size=engine.vocab_size,
            cost=engine.cost_coefficients(),
            long_prompt_after=engine.long_prompt_after,
            role=engine.config.role,
            kv_transfer_endpoint=engine.kv_sender.endpoint or None if engine.kv_sender else None,
        )

    async def stats(self) -> dict[str, Any]:
        """The engine's counters plus torch's thread count, read on the engine thread (the
        thread whose torch pool does the work)."""

        def read(engine: LLMEngine) -> dict[str, Any]:
            torch = sys.modules.get("torch")  # a cost-model engine never imports it
            return {
                **engine.stats(),
                **({"torch_threads": torch.get_num_threads()} if torch else {}),
            }

        return await self.call(read)

    async def cached_blocks(self) -> dict[Any, int]:
        return await self.call(lambda e: e.kv_cache_manager.block_pool.cached_hash_counts())

    async def reset_prefix_cache(self) -> bool:
        return await self.call(lambda e: e.reset_prefix_cache())

    async def add_lora(self, name: str, path: str) -> str:
        """Registers an adapter between steps; returns its folder as registered (what its
        blocks are hashed with). A refusal is a ValueError naming the field.

        The folder is checked on a reader thread under a deadline (``lora.inspect``), and
        only its result is handed to the engine thread: a folder on a hung mount (or a
        FIFO for a file) fails this call alone, never the steps of every request."""
        store = self.llm_engine.lora
        spec = None
        if store is not None:
            spec = await asyncio.wrap_future(store.inspect(str(path)))

        def add(engine: LLMEngine) -> str:
            engine.add_lora(name, path, spec)
            return engine.list_loras()[name]

        return await self.call(add)

    async def remove_lora(self, name: str) -> bool:
        """Unregisters an adapter (requests already queued or running finish with it)."""
        return await self.call(lambda e: e.remove_lora(name))

    async def list_loras(self) -> dict[str, str]:
        return await self.call(lambda e: e.list_loras())

    def inject_failure(self, message: str) -> None:
        """The engine's next step raises ``RuntimeError(message)`` before it schedules, so
        no request is in the failed step's batch (see :class:`EngineDeadError`)."""
        self._injected_failure = message

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        resume: Resume | None = None,
        tenant: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Yields the request's output after each step that changed it, the last finished.
        ``resume``: continue a request that failed over from another replica; ``tenant``:
        whose request (the scheduler takes tenants in turn); ``priority``: lower runs first."""
        if self.error is not None:
            raise EngineDeadError("the engine has failed") from self.error
        if self._stopped:
            raise EngineDeadError("the engine is shut down")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        sink: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        params = params or SamplingParams()
        self.submit(
            rid,
            prompt,
            params,
            _QueueSink(sink, asyncio.get_running_loop()),
            cache_salt=cache_salt,
            lora_name=lora_name,
            resume=resume,
            tenant=tenant,
            priority=priority,
        )
        finished = False
        held: BaseException | None = None
        try:
            while True:
                item = held or await sink.get()
                # Outputs that piled up while the consumer was busy leave as one: a slow
                # consumer gets fewer, larger deltas instead of falling further behind.
                while isinstance(item, RequestOutput) and not item.finished and not sink.empty():
                    nxt = sink.get_nowait()
                    if isinstance(nxt, BaseException):
                        held = nxt
                        break
                    item = _merge(item, nxt)
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._commands.put(Abort(rid))

    def _queue(self, add: Submission) -> None:
        if self._refused_dead(add.request_id, add.sink):
            return
        request_id, params = add.request_id, add.params
        so, compiler = params.structured_outputs, self.llm_engine.structured
        if so is not None and compiler is not None and not compiler.is_compiled(so):
            with self._compiling_lock:
                self._compiling[request_id] = add
                if self._compile_pool is None:
                    self._compile_pool = concurrent.futures.ThreadPoolExecutor(
                        1, thread_name_prefix="kvr-grammar"
                    )
            self._compile_pool.submit(self._compile_then_add, add)
            return
        self._commands.put(add)

    def _refused_dead(self, request_id: str, sink: OutputSink) -> bool:
        """A failed or stopping engine refuses the request at once (True)."""
        if self.error is None and not self._stopped:
            return False
        # The engine thread may still be failing its requests and flushing their sinks, this
        # one among them: a sink is filled and flushed by one thread at a time.
        if threading.current_thread() is not self._thread:
            self._thread.join(5.0)
        why = "the engine has failed" if self.error is not None else "the engine is shut down"
        sink.deliver(request_id, EngineDeadError(why))
        sink.flush()
        return True

    def _compile_then_add(self, add: Submission) -> None:
        """Compiles the request's constraint off the engine thread, then queues it (unless
        it was aborted meanwhile). A constraint that does not compile is queued all the
        same: the engine refuses it with the compiler's reason, as for any bad request."""
        try:
            self.llm_engine.structured.compile(add.params.structured_outputs)  # type: ignore[union-attr]
        except Exception:
            pass  # kept with the grammars: add_request refuses this request alone with it
        with self._compiling_lock:
            if self._compiling.pop(add.request_id, None) is not add:
                return  # aborted while it compiled: nobody waits for it
        if not self._refused_dead(add.request_id, add.sink):  # the engine may have died since
            self._commands.put(add)

    def abort(self, request_id: str) -> None:
        with self._compiling_lock:
            if self._compiling.pop(request_id, None) is not None:
                return  # still compiling: it never reaches the engine
        self._commands.put(Abort(request_id))

    def abort_sink(self, sink: OutputSink) -> None:
        """Aborts every live request of ``sink`` (its reader is gone)."""
        with self._compiling_lock:
            for rid in [r for r, add in self._compiling.items() if add.sink is sink]:
                del self._compiling[rid]
        self._commands.put(AbortSink(sink))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Runs ``fn(engine)`` on the engine thread between steps and returns its result.

        The engine is not thread-safe: stats, cache resets and the like must not run while
        a step mutates the scheduler. ``fn`` raising fails this call only.
        """
        if self.error is not None:
            raise EngineDeadError("the engine has failed") from self.error
        if self._stopped:
            raise EngineDeadError("the engine is shut down")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._commands.put(Call(fn, future, loop))
        return await future

    def wait_failed(self, timeout: float) -> bool:
        """After the engine failed (``errored``): waits until every request it held or had
        queued has been handed its error and its sink flushed. True if that happened."""
        return self._failed.wait(timeout)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stops the engine thread; live streams end with :class:`EngineDeadError`."""
        self._stopped = True
        if self._compile_pool is not None:  # a compilation under way ends by refusing its request
            self._compile_pool.shutdown(wait=False, cancel_futures=True)
            with self._compiling_lock:
                waiting, self._compiling = list(self._compiling.values()), {}
            for add in waiting:  # those whose compilation was cancelled: refused here
                add.sink.deliver(add.request_id, EngineDeadError("the engine is shut down"))
                add.sink.flush()
        self._commands.put(None)
        self._thread.join(timeout)
        if not self._thread.is_alive():  # a request queued while it stopped: fail it too
            self._fail_queued(EngineDeadError("the engine is shut down"))


def _merge(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one: the later state, both deltas."""
    return dataclasses.replace(
        then,
        delta_text=first.delta_text + then.delta_text,
        delta_token_ids=[*first.delta_token_ids, *then.delta_token_ids],
    )
