"""ReplicaEngine: the one surface a replica uses of whichever engine it runs.

A replica (:class:`~.actor.ReplicaServer`, its :class:`~.dataplane_server.DataPlaneServer`) holds
one engine and calls it without asking which kind it is, as vLLM's front end holds one
``EngineCoreClient``. What differs between engines (a thread or an event loop, kvroute's
publisher or vLLM's, how a failure is injected) stays behind this surface.

Implementations:

- :class:`~.async_engine.AsyncLLMEngine`: kvroute's :class:`~.engine.LLMEngine` on a thread
  of its own. A cost-model replica (``model="sim:<profile>"``) is this engine too, not a
  third one: its ``LLMEngine`` runs the real scheduler, block pool and KV events with a
  :class:`~.cost_model_runner.CostModelRunner` (step times from the cost model) in place of
  a model runner.
- :class:`~kvroute.replica.vllm.engine.VllmEngine`: vLLM's ``AsyncLLM`` on an event loop
  of its own thread (``engine="vllm"``); vLLM publishes its own KV events.

Threads: ``submit``, ``abort``, ``abort_sink``, ``inject_failure`` and ``shutdown`` may be
called from any thread; ``load`` and ``error`` are read from any thread at once; the
coroutines are awaited from any event loop (they run between engine steps). Outputs reach
each request's :class:`OutputSink` on the engine's own thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from kvroute.events.kv_transfer import KVSource
    from kvroute.events.load import CostCoefficients, LoadReport
    from kvroute.events.replica_api import Resume, SamplingParams

    from ..core.outputs import EngineOutput

__all__ = ["EngineDeadError", "EngineFacts", "OutputSink", "ReplicaEngine", "Submission"]


class EngineDeadError(RuntimeError):
    """The engine failed; the replica should be restarted.

    ``suspect``: the request was in the step that failed (or that step's batch is unknown),
    so it may have caused the failure and must not be replayed elsewhere blindly. False for
    a request that was only queued or waiting, or that arrived after the engine died."""

    def __init__(self, message: str, *, suspect: bool = False) -> None:
        super().__init__(message)
        self.suspect = suspect


class OutputSink(Protocol):
    """Where a request's outputs go; called on the engine's thread only."""

    # True: the sink takes each step's increment as the data plane's GenerateDelta, built
    # straight from the request; False: a RequestOutput (cumulative text and tokens too).
    deltas: bool

    def deliver(self, request_id: str, item: EngineOutput | BaseException) -> bool:
        """Takes one output (or the error that ends the request); False when nobody listens
        any more (the engine then aborts the request)."""
        ...

    def flush(self) -> None:
        """The step is over: send what this step delivered."""
        ...


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What a replica reports of its engine in its ``ReplicaInfo`` (fixed once started)."""

    model_path: Path
    hash_algo: str
    hash_seed: str
    hash_form: str
    block_size: int
    num_blocks: int
    max_model_len: int
    vocab_size: int
    cost: CostCoefficients
    long_prompt_after: int | None = None  # see ReplicaInfo.long_prompt_after
    role: str = "both"  # see ReplicaInfo.role
    kv_transfer_endpoint: str | None = None  # where its leased blocks are pulled (P/D)


@dataclass(slots=True)
class Submission:
    """One request as :meth:`ReplicaEngine.submit` takes it, for the engine to queue."""

    request_id: str
    prompt: str | Sequence[int]
    params: SamplingParams
    cache_salt: str | None
    lora_name: str | None
    resume: Resume | None
    tenant: str | None
    sink: OutputSink
    kv_handoff: bool = False  # P/D: end after the first token, the prompt's blocks leased
    kv_source: KVSource | None = None  # P/D: pull the prompt's blocks from there
    priority: int = 0  # lower runs first (vLLM's meaning)


class ReplicaEngine(Protocol):
    """A started engine, as a replica drives it (see the module docstring). An engine
    subclasses it for ``submit``, and queues each request in its own ``_queue``."""

    # The scheduler's load as of its latest step or intake: a new object on every change.
    load: LoadReport
    # What ended the engine (set once); requests are refused from then on.
    error: BaseException | None

    @property
    def errored(self) -> bool: ...

    def describe(self) -> EngineFacts:
        """The engine's configuration as resolved at start-up (model folder, hashing,
        cache size, limits, cost coefficients)."""
        ...

    def submit(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        sink: OutputSink,
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        resume: Resume | None = None,
        tenant: str | None = None,
        kv_handoff: bool = False,
        kv_source: KVSource | None = None,
        priority: int = 0,
    ) -> None:
        """Queues a request from any thread; its outputs (or the error that refuses or ends
        it) go to ``sink``. Never blocks, except on a failed or stopping engine: that refuses
        it at once with :class:`EngineDeadError` (once its own thread has failed its
        requests and flushed their sinks)."""
        self._queue(
            Submission(
                request_id,
                prompt,
                params,
                cache_salt,
                lora_name,
                resume,
                tenant,
                sink,
                kv_handoff,
                kv_source,
                priority,
            )
        )

    def _queue(self, sub: Submission) -> None:
        """``submit``'s work, the engine's own: it queues (or refuses) the request."""
        ...

    def abort(self, request_id: str) -> None:
        """Ends a request with ``finish_reason="abort"``; unknown ids are ignored."""
        ...

    def abort_sink(self, sink: OutputSink) -> None:
        """Aborts every live request of ``sink`` without a word to it (its reader is gone)."""
        ...

    async def stats(self) -> dict[str, Any]:
        """Load and cache counters, read between steps."""
        ...

    async def cached_blocks(self) -> dict[Any, int]:
        """External block hash -> cached copies: what a router's index of this replica must
        equal once its event stream is applied."""
        ...

    async def reset_prefix_cache(self) -> bool:
        """False when blocks are in use (nothing is reset then); True after the engine
        cleared its cache and published ``AllBlocksCleared``."""
        ...

    def inject_failure(self, message: str) -> None:
        """Fault injection (tests, drills): the engine fails as a crash would, between steps,
        so no request is named as the cause (each live one may be replayed elsewhere)."""
        ...

    def wait_failed(self, timeout: float) -> bool:
        """After the engine failed (``errored``): waits until every request it held has
        been handed its error and its sink flushed. True if that happened."""
        ...

    def shutdown(self) -> None:
        """Stops the engine; live requests end with :class:`EngineDeadError`."""
        ...
