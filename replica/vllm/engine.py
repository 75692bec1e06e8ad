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

vLLM is imported only here, and only when a replica asks for ``engine="vllm"``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import signal
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvroute.events.kv_transfer import KVSource
from kvroute.events.load import CostCoefficients, LoadReport
from kvroute.events.replica_api import GenerateDelta, Resume, SamplingParams, next_delta
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
    estimate_load,
    from_vllm_output,
    idle_load,
    prepare_environment,
    reported_hash_algo,
    to_vllm_sampling,
)
from .cli import spawn_main
from .disagg import (
    handoff_delta,
    kv_transfer_config,
    pd_params,
    prepare_side_channel,
    with_kv_transfer,
)
from .plugin import CACHED_BLOCKS_METHOD, LOAD_METHOD

__all__ = ["HASH_ALGO", "VllmEngine", "VllmEngineConfig"]

log = logging.getLogger(__name__)

LOAD_POLL_S = 0.05  # scheduler load polled this often while requests run
IDLE_POLL_S = 0.5  # and this often while none do (engine death is noticed here too)
LOAD_CALL_TIMEOUT_S = 5.0  # a load poll unanswered this long (a dead engine core) is skipped


class VllmEngine(ReplicaEngine):
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
        return await self.call(_stats)

    async def cached_blocks(self) -> dict[Any, int]:
        """External block hash -> cached copies in vLLM's prefix cache (needs the plugin)."""
        return await self.call(lambda e: e.llm.engine_core.call_utility_async(CACHED_BLOCKS_METHOD))

    async def reset_prefix_cache(self) -> bool:
        """False when blocks are in use; True after vLLM cleared its cache (and published
        ``AllBlocksCleared``)."""
        return bool(await self.call(lambda e: e.llm.reset_prefix_cache()))

    # -- LoRA adapters: vLLM's LoRARequests, by name (vLLM hashes name and path) ----------
    async def add_lora(self, name: str, path: str) -> str:
        """Registers a PEFT folder under ``name`` in vLLM (read and checked there); returns
        the path vLLM hashes with. A refusal is a ValueError naming the field."""
        return str(await self.call(lambda e: e._add_lora(name, path)))

    async def remove_lora(self, name: str) -> bool:
        return bool(await self.call(lambda e: e._remove_lora(name)))

    async def list_loras(self) -> dict[str, str]:
        return {name: req.lora_path for name, req in self._loras.items()}

    async def _add_lora(self, name: str, path: str) -> str:
        from vllm.lora.request import LoRARequest

        if not name:
            raise ValueError("lora_name must not be empty")
        old = self._loras.get(name)
        if old is not None:
            if old.lora_path != str(path):
                raise ValueError(
                    f"LoRA adapter {name!r} is already registered from {old.lora_path}"
                )
            return str(old.lora_path)
        if not self.config.lora_modules and not self.config.engine_args.get("enable_lora"):
            raise ValueError("this replica serves no LoRA adapters (start it with --enable-lora)")
        if not (Path(path) / "adapter_config.json").is_file():
            raise ValueError(
                f"lora_path {path}: no adapter_config.json (not a PEFT adapter folder)"
            )
        self._lora_ids += 1
        request = LoRARequest(name, self._lora_ids, str(path))
        try:
            await self.llm.add_lora(request)
        except Exception as exc:  # vLLM's own check (rank, targets): the folder's fault
            raise ValueError(f"lora_path {path}: {exc}") from None
        self._loras[name] = request
        return str(request.lora_path)

    async def _remove_lora(self, name: str) -> bool:
        request = self._loras.pop(name, None)
        if request is None:
            return False
        await self.llm.remove_lora(request.lora_int_id)
        return True

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

    # -- requests (the engine's loop) ----------------------------------------------------
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

    async def _watch(self) -> None:
        """Polls the scheduler's load while requests run (and notices a dead engine)."""
        while not self._stopped:
            if self.llm.errored:
                self._died(self.llm.dead_error)
                return
            busy = bool(self._live)
            report = await self._read_load()
            if report != self.load:  # a new object only on a change: the data plane's cue
                self.load = report
            await asyncio.sleep(LOAD_POLL_S if busy else IDLE_POLL_S)

    async def _read_load(self) -> LoadReport:
        if self._plugin:
            try:
                fields = await asyncio.wait_for(
                    self.llm.engine_core.call_utility_async(LOAD_METHOD), LOAD_CALL_TIMEOUT_S
                )
                return LoadReport(**dict(zip(LoadReport.__struct_fields__, fields, strict=False)))
            except TimeoutError:  # a killed engine core may never answer: the watcher goes
                return self.load  # back to asking vLLM whether it has died
            except Exception as exc:
                if self.llm.errored:
                    return self.load
                self._plugin = False
                log.warning(
                    "kvroute's vLLM plugin is not loaded in the engine core (%s): load is "
                    "estimated from this replica's own requests",
                    exc,
                )
        return self._estimate_load()

    def _estimate_load(self) -> LoadReport:
        return estimate_load(list(self._live.values()), self.num_blocks, self.block_size)


async def _stats(engine: VllmEngine) -> dict[str, Any]:
    import vllm

    report = await engine._read_load()
    return {
        "engine": "vllm",
        "vllm_version": vllm.__version__,
        "live_requests": len(engine._live),
        "load_source": "scheduler" if engine._plugin else "estimate",
        **{f: getattr(report, f) for f in report.__struct_fields__},
    }


async def _shutdown(engine: VllmEngine) -> None:
    engine._died(RuntimeError("the engine is shut down"), shutdown=True)
    engine._watcher.cancel()
    engine.llm.shutdown()


def _vllm_platform() -> str:
    from vllm.platforms import current_platform

    return str(current_platform.device_type)
