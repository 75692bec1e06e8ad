"""ReplicaActor: one engine, its data plane and its KV-event publisher inside a Ray actor.

Why the shape:
- The actor holds one engine, a :class:`~.replica_engine.ReplicaEngine` (kvroute's, which
  also runs ``sim:`` cost models, or vLLM's), and calls it without asking which; the engine
  runs on its own thread. Requests and tokens travel on
  the data plane (:class:`~.dataplane_server.DataPlaneServer`, ZeroMQ, one message per front door
  per step), never through Ray: Ray places, starts, restarts and finds the actor, and
  carries its :class:`ReplicaInfo` (the sockets' addresses), load reports and control calls.
- A dead engine thread must not leave a live but useless actor (Ray would never restart it):
  a watchdog lets the failure reach every front door (each live request ends with a
  ``failure`` delta), then ``os._exit(1)`` so Ray restarts the process when the actor has
  ``max_restarts``. The new process binds new ports and starts its event seq at 0;
  ``info().incarnation`` tells the router it changed.
- Messages and errors cross the boundary as :mod:`kvroute.events.replica_api` types (the
  router/replica contract), so a router never imports torch to read them.

Create replicas with :func:`start_replica` (resources, restarts, CPU pinning) or directly:
``ReplicaActor.options(num_cpus=1, max_restarts=-1).remote("r0", {"model": "tiny"})``.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import msgspec
import ray

from kvroute.events.load import LoadReport
from kvroute.events.replica_api import ReplicaDeadError, ReplicaInfo

from ..engine.replica_engine import EngineDeadError, ReplicaEngine
from ..model.cost_model import sim_profile

if TYPE_CHECKING:  # the engine pulls in torch; a router creating actors need not
    from ..engine.llm_engine import EngineConfig

__all__ = ["ReplicaActor", "ReplicaLaunch", "ReplicaServer", "start_replica"]

log = logging.getLogger(__name__)
T = TypeVar("T")

EXIT_GRACE_S = 5.0  # at most this long for in-flight streams to end before the exit
_WILDCARD_HOSTS = ("", "*", "0.0.0.0")


class ReplicaServer:
    """The actor's body; a plain class so it can also be run (and tested) in-process.

    ``events_host``: the interface the event sockets bind on. ``127.0.0.1`` for a local Ray;
    ``0.0.0.0`` binds all interfaces and advertises the node's IP. ``torch_threads`` caps
    torch's intra-op pool: several replicas sharing a host must not each spin a full one.
    """

    def __init__(
        self,
        replica_id: str,
        engine_config: EngineConfig | dict[str, Any],
        events_host: str = "127.0.0.1",
        torch_threads: int | None = None,
        launch: dict[str, Any] | None = None,
    ) -> None:
        quiet_progress_bars()
        from ..vllm.adapt import is_vllm_config
        from .dataplane_server import DataPlaneServer

        self.replica_id = replica_id
        # How it was started, for ``kvroute scale`` to start more like it (:meth:`launch_spec`).
        self._launch = ReplicaLaunch(
            replica_id,
            dict(engine_config) if isinstance(engine_config, dict) else engine_config,
            events_host,
            torch_threads,
            dict(launch or {}),
        )
        node_ip = ray.util.get_node_ip_address()
        bind = "*" if events_host in _WILDCARD_HOSTS else events_host
        advertised = node_ip if bind == "*" else events_host
        start = _start_vllm if is_vllm_config(engine_config) else _start_kvroute
        started = start(engine_config, replica_id, bind, advertised, torch_threads)
        self.engine: ReplicaEngine = started.engine
        self.publisher: Any = started.publisher  # kvroute's own; None: the engine publishes
        incarnation = uuid.uuid4().hex
        try:
            self.dataplane = DataPlaneServer(self.engine, f"tcp://{bind}:*", incarnation)
        except BaseException:
            self._close_engine()
            raise
        try:
            facts = self.engine.describe()
        except BaseException:
            self.dataplane.close()
            self._close_engine()
            raise
        actor_id = ray.get_runtime_context().get_actor_id() if ray.is_initialized() else None
        self._in_actor = actor_id is not None
        self._info = ReplicaInfo(
            replica_id=replica_id,
            model=started.model,
            model_path=str(facts.model_path),
            hash_algo=facts.hash_algo,
            hash_seed=facts.hash_seed,
            hash_form=facts.hash_form,
            block_size=facts.block_size,
            num_blocks=facts.num_blocks,
            max_model_len=facts.max_model_len,
            data_endpoint=_advertise(self.dataplane.endpoint, advertised),
            events_endpoint=started.events_endpoint,
            replay_endpoint=started.replay_endpoint,
            topic=replica_id,
            node_ip=node_ip,
            pid=os.getpid(),
            incarnation=incarnation,
            restarted=self._in_actor and _was_reconstructed(),
            vocab_size=facts.vocab_size,
            cost=facts.cost,
            long_prompt_after=facts.long_prompt_after,
            role=facts.role,
            kv_transfer_endpoint=(
                _advertise(facts.kv_transfer_endpoint, advertised)
                if facts.kv_transfer_endpoint
                else None
            ),
            node_id=ray.get_runtime_context().get_node_id() if ray.is_initialized() else None,
        )
        threading.Thread(target=self._watch, name="kvroute-replica-watchdog", daemon=True).start()
        # The model is loaded: what lives now (torch, transformers, the weights' modules)
        # leaves the collector's reach. A full collection would walk all of it, a pause in
        # which no engine step runs; frozen, a collection skips it.
        gc.collect()
        gc.freeze()

    def __repr__(self) -> str:  # Ray prefixes the actor's log lines and errors with it
        return f"ReplicaServer({self.replica_id})"

    def info(self) -> ReplicaInfo:
        return self._info

    def launch_spec(self) -> ReplicaLaunch:
        """How this replica was started: a new one started so is its twin (same engine, same
        Ray resources), but for its id and name."""
        return self._launch

    def drain_status(self) -> tuple[int, int]:
        """(requests waiting or running in the engine, requests received so far): a
        draining replica may stop once the first is 0 and the second stopped moving (no
        front door still sends it work)."""
        load = self.engine.load
        return load.num_waiting + load.num_running, self.dataplane.requests

    def undrain(self) -> None:
        """Taken back from draining (a retirement that was interrupted): routers route to
        it again from their next poll."""
        if self._info.draining:
            log.info("replica %s: no longer draining", self.replica_id)
            self._info = msgspec.structs.replace(self._info, draining=False)

    def drain(self) -> None:
        """Retire: routers stop sending new requests once they read ``draining`` in
        :meth:`info` (their next poll); what already runs here goes on to its end."""
        if not self._info.draining:
            log.info("replica %s: draining", self.replica_id)
            self._info = msgspec.structs.replace(self._info, draining=True)

    def abort(self, request_id: str) -> None:
        """Ends a request (its stream finishes with ``finish_reason="abort"``); unknown or
        finished ids are ignored."""
        self.engine.abort(request_id)

    async def stats(self) -> dict[str, Any]:
        """Engine load and cache counters (read between steps) plus the publisher's."""
        s = await self._ask(self.engine.stats())
        s.update(
            replica_id=self.replica_id,
            dataplane_requests=self.dataplane.requests,
            dataplane_messages_sent=self.dataplane.messages_sent,
            dataplane_malformed=self.dataplane.malformed,
        )
        pub = self.publisher
        if pub is not None:  # a vLLM replica's publisher lives in vLLM's engine core
            s.update(
                events_published=pub.published,
                events_sent=pub.sent,
                events_dropped=pub.dropped,
                events_last_seq=pub.last_seq,
            )
        return s

    async def cached_blocks(self) -> dict[Any, int]:
        """External block hash -> cached copies, read between steps: what a router's index
        of this replica must equal once its event stream is applied (audits, chaos tests)."""
        return await self._ask(self.engine.cached_blocks())

    def load(self) -> LoadReport:
        """The scheduler's load as of its latest step (routers poll it every few hundred
        ms); answered at once, even in the middle of a long step."""
        self.health()
        return self.engine.load

    async def reset_prefix_cache(self) -> bool:
        """False when blocks are in use (nothing is reset then); True after AllBlocksCleared."""
        return await self._ask(self.engine.reset_prefix_cache())

    # -- LoRA adapters (the router's registry keeps every replica's the same) ----------------
    async def add_lora(self, name: str, path: str) -> str:
        """Registers a PEFT adapter folder under ``name``; returns the folder as registered
        (the router hashes adapter blocks with it). ValueError says what is refused."""
        add = getattr(self.engine, "add_lora", None)
        if add is None:
            raise ValueError("LoRA adapters are not served by this replica's engine (vllm)")
        return str(await self._ask(add(name, path)))

    async def remove_lora(self, name: str) -> bool:
        """Unregisters an adapter; requests already running on it finish. False: unknown."""
        remove = getattr(self.engine, "remove_lora", None)
        return bool(await self._ask(remove(name))) if remove is not None else False

    async def list_loras(self) -> dict[str, str]:
        """Registered adapters: name -> folder."""
        listed = getattr(self.engine, "list_loras", None)
        return dict(await self._ask(listed())) if listed is not None else {}

    def health(self) -> bool:
        """True, or :class:`ReplicaDeadError` in the moment before a dead replica exits."""
        if self.engine.errored:
            raise ReplicaDeadError(
                f"replica {self.replica_id}: engine failed: {self.engine.error!r}"
            )
        return True

    def inject_engine_failure(self, message: str = "injected engine failure") -> None:
        """Fault injection (tests, drills): the engine's next step raises ``message``
        (a vLLM replica's engine-core process is killed instead: its steps run there)."""
        self.engine.inject_failure(message)

    def shutdown(self) -> None:
        """For in-process use: stop the engine (live requests fail) and close the sockets."""
        self.engine.shutdown()
        self.dataplane.close()
        if self.publisher is not None:
            self.publisher.close()

    def _close_engine(self) -> None:
        """A start-up that failed after the engine started: stop it, close its publisher."""
        self.engine.shutdown()
        if self.publisher is not None:
            self.publisher.close()

    async def _ask(self, pending: Awaitable[T]) -> T:
        """Awaits an engine call; a dead engine's error becomes the replica's."""
        try:
            return await pending
        except EngineDeadError as exc:
            raise ReplicaDeadError(f"replica {self.replica_id}: {exc}") from None

    def _watch(self) -> None:
        """Exit the process once the engine thread has died (inside a Ray actor only)."""
        while not self.engine.errored:
            time.sleep(0.1)
        log.error("replica %s: engine died (%r)", self.replica_id, self.engine.error)
        if not self._in_actor:
            return
        # Every live request's failure delta must leave before the process does.
        self.engine.wait_failed(EXIT_GRACE_S)
        time.sleep(0.2)  # what was handed to ZeroMQ's own I/O thread must leave too
        log.error("replica %s: exiting so Ray restarts it", self.replica_id)
        sys.stderr.flush()
        os._exit(1)


ReplicaActor = ray.remote(ReplicaServer)


def quiet_progress_bars() -> None:
    """No tqdm bars from a replica: Ray relays every replica's output to the driver's
    console, where several bars redrawn at once interleave into noise. A replica's loading
    progress is reported by ``kvroute serve`` itself (replicas ready, after how long)."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    os.environ["TQDM_DISABLE"] = "1"  # tqdm >= 4.66 reads it for every bar it makes
    # Modules imported before the variables were set read them too late: tell them again.
    if "huggingface_hub" in sys.modules:
        sys.modules["huggingface_hub"].utils.disable_progress_bars()
    if "transformers" in sys.modules:
        sys.modules["transformers"].utils.logging.disable_progress_bar()


def start_replica(
    replica_id: str,
    engine_config: EngineConfig | dict[str, Any],
    *,
    num_cpus: float = 1,
    num_gpus: float = 0,
    max_restarts: int = -1,
    events_host: str = "127.0.0.1",
    torch_threads: int | None = None,
    **options: Any,
) -> Any:
    """Creates a replica actor; returns its handle (``info()`` waits until it is up).

    ``torch_threads`` defaults to ``num_cpus`` (at least 1) for a CPU replica. A CPU replica
    (``num_gpus=0``) runs on the CPU even on a GPU node: Ray leaves the GPUs visible to it.
    Generate calls are never retried by Ray (``max_task_retries=0``): a retried stream
    would repeat tokens. ``options`` go to ``ReplicaActor.options`` (name, scheduling, ...).
    """
    if not num_gpus:
        if isinstance(engine_config, dict):
            engine_config = {"device": "cpu", **engine_config}
        elif engine_config.device is None:
            engine_config = dataclasses.replace(engine_config, device="cpu")
        if torch_threads is None:
            torch_threads = max(1, int(num_cpus))
    actor_cls = ReplicaActor.options(  # type: ignore[attr-defined]
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        max_restarts=max_restarts,
        max_task_retries=0,
        **options,
    )
    launch = {"num_cpus": num_cpus, "num_gpus": num_gpus, "max_restarts": max_restarts}
    launch.update((k, v) for k, v in options.items() if k != "name")
    return actor_cls.remote(replica_id, engine_config, events_host, torch_threads, launch)


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicaLaunch:
    """A replica's start as :func:`start_replica` made it: the engine's configuration, the
    event sockets' host, torch's threads, and the Ray options (resources, runtime_env,
    lifetime, restarts; not the name, which is each replica's own)."""

    replica_id: str
    engine_config: Any  # EngineConfig or its dict, as given
    events_host: str
    torch_threads: int | None
    options: dict[str, Any]

    def start(self, replica_id: str, name: str, **options: Any) -> Any:
        """Another replica like this one, ``replica_id`` named ``name``: its handle. A KV
        disk folder named after this replica (``kvroute serve``: ``<path>/<replica id>``,
        wiped at start) is named after the new one instead. ``options`` override Ray's."""
        opts = {**self.options, **options}
        config = self.engine_config
        folder = _config_value(config, "kv_disk_path")
        if folder and os.path.basename(os.path.normpath(folder)) == self.replica_id:
            own = os.path.join(os.path.dirname(os.path.normpath(folder)), replica_id)
            config = (
                {**config, "kv_disk_path": own}
                if isinstance(config, dict)
                else dataclasses.replace(config, kv_disk_path=own)
            )
        return start_replica(
            replica_id,
            config,
            num_cpus=opts.pop("num_cpus", 1),
            num_gpus=opts.pop("num_gpus", 0),
            max_restarts=opts.pop("max_restarts", -1),
            events_host=self.events_host,
            torch_threads=self.torch_threads,
            name=name,
            **opts,
        )


def _was_reconstructed() -> bool:
    with warnings.catch_warnings():  # Ray 2.60's own property trips its deprecation warning
        warnings.simplefilter("ignore", DeprecationWarning)
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)


def _advertise(endpoint: str, host: str) -> str:
    """``tcp://0.0.0.0:5557`` as bound -> ``tcp://<host>:5557`` as others reach it."""
    port = endpoint.rsplit(":", 1)[1]
    return f"tcp://{host}:{port}"


class _Started(NamedTuple):
    """A replica's engine as started, with what the replica reports beside it."""

    engine: ReplicaEngine
    publisher: Any  # kvroute's ZmqEventPublisher, or None where the engine publishes
    model: str
    events_endpoint: str
    replay_endpoint: str | None


def _start_kvroute(
    engine_config: EngineConfig | dict[str, Any],
    replica_id: str,
    bind: str,
    advertised: str,
    torch_threads: int | None,
) -> _Started:
    """kvroute's engine on its thread (a ``sim:`` model too), and its event publisher."""
    from kvroute.events.transport import ZmqEventPublisher

    from ..engine.async_engine import AsyncLLMEngine
    from ..engine.llm_engine import EngineConfig

    config = (
        engine_config if isinstance(engine_config, EngineConfig) else EngineConfig(**engine_config)
    )
    if config.kv_transfer:  # other replicas know it by its id; its blocks are served on bind
        config = dataclasses.replace(
            config, replica_id=replica_id, kv_transfer_bind=f"tcp://{bind}:*"
        )
    if torch_threads is not None and sim_profile(config.model) is None:
        import torch  # a cost-model replica never imports it

        torch.set_num_threads(torch_threads)
    publisher = ZmqEventPublisher(f"tcp://{bind}:*", f"tcp://{bind}:*", topic=replica_id)
    try:
        engine = AsyncLLMEngine.from_config(config, [publisher.publish])
    except BaseException:
        publisher.close()
        raise
    sender = engine.llm_engine.kv_sender
    if sender is not None and sender.endpoint:  # handoffs name the address others reach
        sender.endpoint = _advertise(sender.endpoint, advertised)
    replay = publisher.replay_endpoint
    return _Started(
        engine,
        publisher,
        config.model,
        _advertise(publisher.endpoint, advertised),
        _advertise(replay, advertised) if replay else None,
    )


def _start_vllm(
    engine_config: Any, replica_id: str, bind: str, advertised: str, torch_threads: int | None
) -> _Started:
    """vLLM's AsyncLLM (see :mod:`.vllm_engine`): vLLM publishes its own KV events, so
    there is no kvroute publisher."""
    from ..vllm.engine import VllmEngine, VllmEngineConfig

    config = (
        engine_config
        if isinstance(engine_config, VllmEngineConfig)
        else VllmEngineConfig.from_dict(engine_config)
    )
    if torch_threads is not None and config.device == "cpu":
        # vLLM's engine core (a child process) sizes its OpenMP pool from this.
        os.environ["OMP_NUM_THREADS"] = str(torch_threads)
    engine = VllmEngine(config, events_host=advertised, topic=replica_id)
    return _Started(engine, None, config.model, engine.events_endpoint, engine.replay_endpoint)


def _config_value(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)
