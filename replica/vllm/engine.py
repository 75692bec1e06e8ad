"""VllmEngine: vLLM's ``AsyncLLM`` behind :class:`~.replica_engine.ReplicaEngine`, the surface
a kvroute replica uses of its engine.

Why an adapter and not a second replica: the actor's lifecycle (detached, named,
restartable), the data plane (one message per front door per step, load frames, heartbeats)
and :class:`~kvroute.events.replica_api.ReplicaInfo` stay the ones every front door knows.
Only the engine changes: the actor and the data plane call it exactly as they call
:class:`~.async_engine.AsyncLLMEngine`.

How it maps:
- ``AsyncLLM`` is asyncio-native, so it runs on an event loop owned by one thread here;
  callers on other threads (the data plane's I/O thread, Ray's) hand work over with
  ``call_soon_threadsafe``. Each request is one task iterating ``AsyncLLM.generate`` with
  ``RequestOutputKind.DELTA``; vLLM's output handler wakes every request of an engine step
  in one loop iteration, so a flush scheduled behind them sends each front door one
  message per step, as kvroute's own engine does.
- KV events are vLLM's own: its ZMQ publisher and replay socket in the engine-core
  process, bound on ports it picks and reports back (``get_kv_event_sources``). Prefix
  caching uses ``sha256_cbor``, which kvroute reproduces (``sha256_cbor_tagged``: vLLM
  0.32 tags the cache salt), so routers index vLLM's hashes exactly. Asked for another
  (``engine_args={"prefix_caching_hash_algo": "sha256"}``), the replica reports
  ``vllm:sha256`` and routers index its events by token ids. A tenant's salt is vLLM's
  ``cache_salt``.
- Load: the scheduler's own figures through a utility call added by kvroute's vLLM plugin
  (:mod:`.vllm_plugin`), polled while requests run; without the plugin, counts kept here.
  Cost coefficients: kvroute's roofline from the model's config and a start-up
  measurement of this device (:func:`~.cost_model.profile_for_model`), as for its own
  engine -- not vLLM's measured step times.
- A dead engine core fails every live request (``suspect``: vLLM does not say which
  request was in the step that failed) and sets ``error``; the actor then exits so Ray
  restarts it.

vLLM is imported only here (with the modules below), and only when a replica asks for
``engine="vllm"``.

This file holds the adapter's surface and lifecycle (start-up, what it reports, fault
injection, shutdown); beside it, mixins of :class:`VllmEngine`: :mod:`.live_requests`
(each request's task on the loop, deliveries and flushes, a dead engine core),
:mod:`.load_watch` (the load poll and ``stats``) and :mod:`.lora_requests` (vLLM's
``LoRARequest``s by name).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from kvroute.events.load import CostCoefficients
from kvroute.events.transport.threads import name_native_thread

from ..engine.replica_engine import (
    EngineDeadError,
    EngineFacts,
    OutputSink,
    ReplicaEngine,
    Submission,
)
from .adapt import (
    HASH_ALGO,
    VLLM_DEFAULT_SEED,
    LiveRequest,
    VllmEngineConfig,
    count_params,
    engine_args,
    idle_load,
    prepare_environment,
    reported_hash_algo,
)
from .cli import spawn_main
from .disagg import (
    kv_transfer_config,
    prepare_side_channel,
)
from .live_requests import VllmRequests
from .load_watch import VllmLoad, engine_stats
from .lora_requests import VllmLoRA
from .plugin import CACHED_BLOCKS_METHOD

__all__ = ["HASH_ALGO", "VllmEngine", "VllmEngineConfig"]

log = logging.getLogger(__name__)


class VllmEngine(VllmRequests, VllmLoad, VllmLoRA, ReplicaEngine):
    """``AsyncLLM`` on a loop of its own thread: a replica's
    :class:`~.replica_engine.ReplicaEngine`."""

    def __init__(
        self, config: VllmEngineConfig, *, events_host: str = "127.0.0.1", topic: str = "kv"
    ) -> None:
        from ..model.models import resolve_model

        self.config = config
        self.model_path = resolve_model(config.model)
        self.error: BaseException | None = None
        self._failed = threading.Event()  # set once a failure has reached every request
        self._stopped = False
        self._live: dict[str, LiveRequest] = {}
        self._touched: set[OutputSink] = set()
        self._flush_scheduled = False
        self._plugin = True  # the scheduler's load comes by utility call until one fails
        self._loras: dict[str, Any] = {}  # name -> vLLM's LoRARequest
        self._lora_ids = 0
        self.load = idle_load(0)
        prepare_environment(config, events_host)
        if config.role != "both":  # P/D: NixlConnector's handshake port and address
            prepare_side_channel(events_host, config.device == "cpu")
        self._loop = asyncio.new_event_loop()
        started: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run, args=(started, topic), name="kvr-vllm", daemon=True
        )
        self._thread.start()
        started.result()  # the start-up error, if any, raised here

    # -- what the actor and the data plane use (any thread) -------------------------------
    @property
    def errored(self) -> bool:
        return self.error is not None

    def _queue(self, sub: Submission) -> None:
        """``tenant`` is not used: vLLM's scheduler has no per-tenant turns; ``priority``
        goes to vLLM's (its ``scheduling_policy="priority"``, :func:`.adapt.engine_args`)."""
        request_id, sink = sub.request_id, sub.sink
        if self.error is not None or self._stopped:
            # The loop may still be failing its requests and flushing their sinks, this one
            # among them: a sink is filled and flushed by one thread at a time.
            if self.error is not None and threading.current_thread() is not self._thread:
                self._failed.wait(5.0)
            why = "the engine has failed" if self.error is not None else "the engine is shut down"
            sink.deliver(request_id, EngineDeadError(why))
            sink.flush()
            return
        args = (request_id, sub.prompt, sub.params, sink, sub.cache_salt, sub.resume, sub.lora_name)
        pd = (sub.kv_handoff, sub.kv_source)  # P/D: vLLM's kv_transfer_params (.disagg)
        self._loop.call_soon_threadsafe(self._start_request, *args, *pd, sub.priority)

    def abort(self, request_id: str) -> None:
        """Ends a request with ``finish_reason="abort"``; unknown ids are ignored."""
        self._call_soon(self._abort, request_id)

    def abort_sink(self, sink: OutputSink) -> None:
        """Aborts every live request of ``sink`` without a word to it (its reader is gone)."""
        self._call_soon(self._abort_sink, sink)

    def run(self, fn: Callable[[VllmEngine], Any], timeout: float | None = None) -> Any:
        """Runs the coroutine ``fn(self)`` on the engine's loop; blocks for its result."""
        return asyncio.run_coroutine_threadsafe(fn(self), self._loop).result(timeout)

    async def call(self, fn: Callable[[VllmEngine], Any]) -> Any:
        """As :meth:`run`, awaited from another event loop (the actor's)."""
        if self.error is not None:
            raise EngineDeadError("the engine has failed") from self.error
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(fn(self), self._loop))

    async def stats(self) -> dict[str, Any]:
        """The scheduler's load and this adapter's counts (read on the engine's loop)."""
        return await self.call(engine_stats)

    async def cached_blocks(self) -> dict[Any, int]:
        """External block hash -> cached copies in vLLM's prefix cache (needs the plugin)."""
        return await self.call(lambda e: e.llm.engine_core.call_utility_async(CACHED_BLOCKS_METHOD))

    async def reset_prefix_cache(self) -> bool:
        """False when blocks are in use; True after vLLM cleared its cache (and published
        ``AllBlocksCleared``)."""
        return bool(await self.call(lambda e: e.llm.reset_prefix_cache()))

    def describe(self) -> EngineFacts:
        return EngineFacts(
            model_path=self.model_path,
            hash_algo=self.hash_algo,
            hash_seed=self.hash_seed,
            hash_form=self.hash_form,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            cost=self.cost_coefficients(),
            role=self.config.role,
        )

    def inject_failure(self, message: str) -> None:
        """Fault injection: vLLM's steps run in its engine-core process, so that process is
        killed (``message`` is not used: the failure is vLLM's own report of the death)."""
        self.kill_engine_core()

    def kill_engine_core(self) -> None:
        """SIGKILL vLLM's engine-core process, as a crash would."""
        for pid in self.engine_core_pids:
            os.kill(pid, signal.SIGKILL)

    @property
    def engine_core_pids(self) -> list[int]:
        manager = getattr(self.llm.engine_core.resources, "engine_manager", None)
        return [p.pid for p in getattr(manager, "processes", ()) if p.pid is not None]

    def wait_failed(self, timeout: float) -> bool:
        """After the engine failed (``errored``): waits until every live request has been
        handed its error and its sink flushed. True if that happened."""
        return self._failed.wait(timeout)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stops vLLM (its processes end) and the loop; live requests end as failed."""
        if self._stopped:
            return
        self._stopped = True
        if self._thread.is_alive():
            try:
                self.run(_shutdown, timeout)
            except Exception:
                log.exception("vLLM shutdown failed")
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)

    # -- start-up (the engine's thread) --------------------------------------------------
    def _run(self, started: concurrent.futures.Future[None], topic: str) -> None:
        name_native_thread()
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._start(topic))
        except BaseException as exc:
            started.set_exception(exc)
            self._loop.close()
            return
        started.set_result(None)
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    async def _start(self, topic: str) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        cpu = self.config.device == "cpu" or _vllm_platform() == "cpu"
        args = engine_args(self.config, self.model_path, cpu, topic)
        if args.kv_transfer_config is None:  # P/D: vLLM's NixlConnector (unless given)
            args.kv_transfer_config = kv_transfer_config(self.config.role, cpu)
        with spawn_main():  # the engine core's process hides broken torch companions too
            self.llm = AsyncLLM.from_engine_args(args)
        try:
            self._describe()
            for name, path in self.config.lora_modules.items():
                await self._add_lora(name, path)
        except BaseException:
            self.llm.shutdown()
            raise
        self._watcher = asyncio.get_running_loop().create_task(self._watch())

    def _describe(self) -> None:
        """What the replica reports: vLLM's resolved configuration, its event sockets."""
        import vllm.envs as envs

        vc = self.llm.vllm_config
        self.block_size: int = vc.cache_config.block_size
        self.num_blocks: int = (vc.cache_config.num_gpu_blocks or 1) - 1  # less the null block
        self.max_model_len: int = vc.model_config.max_model_len
        self.vocab_size: int = vc.model_config.get_vocab_size()
        self.hash_seed = os.environ.get("PYTHONHASHSEED") or VLLM_DEFAULT_SEED
        self.hash_algo: str = reported_hash_algo(vc.cache_config.prefix_caching_hash_algo)
        self.hash_form = "int" if envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES else "bytes"
        sources = self.llm.get_kv_event_sources()
        if not sources:
            raise RuntimeError("vLLM started without a KV-event publisher")
        src = sources[min(sources)]
        self.events_endpoint: str = src.endpoint
        self.replay_endpoint: str | None = src.replay_endpoint
        self.max_num_batched_tokens: int = vc.scheduler_config.max_num_batched_tokens
        self.max_num_seqs: int = vc.scheduler_config.max_num_seqs
        self.dtype_bytes: int = vc.model_config.dtype.itemsize
        self.tokenizer = self.llm.get_tokenizer()
        self.load = idle_load(self.num_blocks)

    def cost_coefficients(self) -> CostCoefficients:
        """kvroute's roofline for this model and device (see the module docstring)."""
        from transformers import AutoConfig

        from ..model.cost_model import CostModel, profile_for_model

        gpu = None
        try:
            import torch

            if self.config.device != "cpu" and torch.cuda.is_available():
                gpu = torch.cuda.get_device_name()
        except Exception:
            gpu = None
        profile = profile_for_model(
            name=f"vllm:{self.config.model}@{gpu or 'cpu'}",
            config=AutoConfig.from_pretrained(self.model_path),
            num_params=count_params(self.model_path),
            dtype_bytes=self.dtype_bytes,
            kv_tokens=self.num_blocks * self.block_size,
            max_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            device_name=gpu,
        )
        return CostModel(profile).coefficients()


async def _shutdown(engine: VllmEngine) -> None:
    engine._died(RuntimeError("the engine is shut down"), shutdown=True)
    engine._watcher.cancel()
    engine.llm.shutdown()


def _vllm_platform() -> str:
    from vllm.platforms import current_platform

    return str(current_platform.device_type)
