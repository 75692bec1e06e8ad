"""FrontDoor: one router's runtime -- its fleet, admission, policy and quarantine -- and
where a request becomes a :class:`RequestRun`.

One object per router process, used from one asyncio loop (the HTTP server's). It holds
what changes together in its own parts and only wires them:

- :class:`~.fleet.Fleet`: replicas, discovery, data-plane connections, health, and the
  feeds routing reads (KV events into the prefix index, load reports into the load view).
- :class:`~.admission.Admission`: tenant limits, fair share, the in-flight budget and its
  waiters. Intake admits a request before it reads its body.
- the :class:`~.policy.Policy`, which picks a replica for each request from the fleet's
  index and load view;
- :class:`~.quarantine.Quarantine`: requests that may have killed a replica, refused.
- :class:`~.lora.LoRARegistry`: the fleet's LoRA adapters and which replicas hold each;
  a request under an adapter is routed among its holders only (every live replica is
  re-synced every ``lora_resync_s``, so one that could not take an adapter is retried).
  Under ``kvroute router``/``serve`` it is a copy of the fleet's one registry actor
  (:mod:`.lora_shared`), shared by every front door and polled every ``LORA_POLL_S``.
- :class:`~.request_run.RequestRun`: one request from routing to its end (failover
  included), made by :meth:`FrontDoor.run`.

Why the parts are handed out, not the front door: each user gets what it needs and no
more -- a run its :class:`~.request_run.RunServices`, the intake the admission and the
fleet's facts, /metrics a :class:`~.metrics.FleetCollector` -- so what a part can reach is
read in its constructor. Each part keeps its own error counts; :attr:`FrontDoor.errors`
sums them (with those of the request path and of the HTTP layer, added by
:meth:`add_error_counts`) for /metrics and tests.

On a request's path (see :mod:`.api.app`) the front door is one stop: :mod:`.intake`
calls :meth:`FrontDoor.run` and goes on with the run it returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from functools import partial
from types import MappingProxyType
from typing import Any

from kvroute.events.replica_api import GenerateRequest, ReplicaInfo, SamplingParams

from .api.errors import new_id
from .api.flow_metrics import FlowCollector, flow_wait_family, observe_wait
from .api.metrics import FleetCollector, Metrics
from .fleet.admission import Admission, Ticket
from .fleet.fleet import Fleet, FleetMismatchError
from .fleet.flow import DEFAULT_TOKENS, FlowControl, others_waiting
from .fleet.membership import Membership
from .fleet.quarantine import Quarantine, fingerprint
from .fleet.request_run import RequestRun, RunServices
from .fleet.tenants import Tenant
from .lora.registry import Adapter, HolderReplicas, LoRARegistry, not_found
from .lora.shared import LORA_POLL_S
from .routing.policies import make_policy
from .routing.policy import KVPolicy, Policy, RequestView

__all__ = ["FleetMismatchError", "FrontDoor"]

log = logging.getLogger(__name__)

MAX_ADAPTER_LABELS = 256  # past this many adapters in /metrics, the rest share "other"
OTHER_ADAPTER = "other"
LORA_RESYNC_S = 30.0  # how often every live replica's adapters are checked (and retried)


class FrontDoor:
    """Fleet + admission + policy + quarantine, for one router."""

    def __init__(
        self,
        replicas: Sequence[tuple[Any, ReplicaInfo]],
        *,
        policy: str = "kv",
        tokenizer: Any = None,
        monitor_interval_s: float = 2.0,
        load_interval_s: float = 0.2,
        max_in_flight: int | None = None,
        max_in_flight_per_tenant: int | None = None,
        admission_queue: int | None = None,
        admission_timeout_s: float = 2.0,
        lora_adapters: Mapping[str, str] | None = None,
        served_model: str | None = None,
        lora_holders: Mapping[str, Collection[str]] | None = None,
        lora_resync_s: float = LORA_RESYNC_S,
        lora_shared: Any = None,
        find_replicas: Callable[[], Awaitable[dict[str, Any]]] | None = None,
        admission_for: Callable[[int], tuple[int | None, int | None, int]] | None = None,
        pd_split: str = "priced",
        prefix_fetch: bool = False,
        pd_pair: bool = False,
        flow_depth: int | None = None,
        flow_max_waiting: int | None = None,
        flow_tokens: int | None = DEFAULT_TOKENS,
    ) -> None:
        """Admission's limits: see :class:`Admission`; the intervals: see :class:`Fleet`.
        ``lora_adapters``: the fleet's adapters at start (name -> folder, as the replicas
        registered them); ``lora_holders``: name -> the replica ids holding it (what
        :func:`~.lora.prepare_fleet` found; None: every replica holds every one);
        ``lora_resync_s``: how often the adapters of every live replica are synced (0:
        never); ``lora_shared``: the fleet's registry actor, shared with the other front
        doors (:mod:`.lora_shared`; None: this front door's own). ``served_model``: the
        name clients call the base model by (the fleet's own is accepted too); neither may
        name an adapter. ``find_replicas``: the replicas that exist now, by id, read every
        ``monitor_interval_s`` (replicas join and leave a running fleet: ``kvroute scale``);
        ``admission_for``: admission's limits (in flight, per tenant, queue) for a fleet of
        n replicas, applied whenever n changes (None: the limits given stay). ``pd_split``:
        with prefill and decode replicas, "priced" splits a request only where it pays,
        "always" splits every request that can be (routing/disagg.py). ``prefix_fetch``: a
        request may be placed on a replica that pulls its prefix from another's cache,
        where the price says so (routing/fetch.py; replicas with a transfer plane only).
        ``pd_pair``: on a fleet of both, a request may split between any two replicas
        (prefill on one, decode on another), priced per request (routing/disagg.py).
        ``flow_depth``: flow control (:mod:`.flow`): requests without a first token this
        front door keeps on each replica, the rest waiting here by priority and tenant
        (None: off, every request sent at once); ``flow_max_waiting``: waiters per priority
        band, past which a 429 (None: no bound); ``flow_tokens``: their prompt tokens."""
        if pd_split not in ("priced", "always"):
            raise ValueError(f"pd_split must be priced or always, got {pd_split!r}")
        self.counters: Counter[str] = Counter()  # requests, retries, failovers
        self.run_errors: Counter[str] = Counter()  # the runs' own (no replica, invalid)
        self.fleet = fleet = Fleet(
            replicas, monitor_interval_s=monitor_interval_s, load_interval_s=load_interval_s
        )
        self.admission = Admission(
            max_in_flight, max_in_flight_per_tenant, admission_queue, admission_timeout_s
        )
        self.quarantine = Quarantine()
        self.metrics = Metrics()
        self.flow: FlowControl | None = None
        if flow_depth is not None:
            waits = flow_wait_family(self.metrics)
            self.flow = FlowControl(
                flow_depth, flow_max_waiting, flow_tokens, on_wait=partial(observe_wait, waits)
            )
            self.flow.others = partial(others_waiting, fleet.load, self.flow)
            fleet.on_removed.append(self.flow.wake)
            fleet.on_members.append(self.flow.wake)
            self.metrics.registry.register(FlowCollector(self.flow))
        self._error_counts: list[Counter[str]] = [
            fleet.errors, self.admission.errors, self.quarantine.errors, self.run_errors
        ]  # fmt: skip
        self._services = RunServices(
            replicas=fleet,
            policy=make_policy(
                policy, index=fleet.index, block_size=fleet.hasher.block_size, load=fleet.load
            ),
            quarantine=self.quarantine,
            release=self.admission.release,
            metrics=self.metrics,
            counters=self.counters,
            errors=self.run_errors,
            pd_priced=pd_split == "priced",
            pd_pair=pd_pair,
            flow=self.flow,
        )
        self.prefix_fetch = prefix_fetch
        self._arm_fetch(self.policy)
        fleet.on_removed.append(lambda rid: self.policy.on_replica_removed(rid))
        self.membership = Membership(fleet, find_replicas) if find_replicas else None
        if admission_for is not None:
            fleet.on_members.append(lambda n: self.admission.resize(*admission_for(n)))
        adapters = dict(lora_adapters or {})
        if lora_holders is None:
            lora_holders = {name: list(fleet.replicas) for name in adapters}
        self.loras = LoRARegistry({fleet.model, served_model or fleet.model}, adapters,
                                  lora_holders, shared=lora_shared)  # fmt: skip
        self.lora_resync_s = lora_resync_s
        self._resync: asyncio.Task[None] | None = None
        self.fleet_collector = FleetCollector(
            fleet,
            self.metrics,
            self.counters,
            errors=lambda: self.errors,
            quarantined=self.quarantine.refused,
            in_flight=lambda: self.admission.in_flight,
            lora_holders=lambda: self.loras.holder_counts(fleet.alive()),
        )
        self.metrics.registry.register(self.fleet_collector)
        self._error_counts.append(self.loras.errors)
        fleet.prepare = self._prepare_replica
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(fleet.model_path)
        self.tokenizer = tokenizer
        # What an HTTP backend's resumed request needs (kvroute's replicas decode themselves).
        fleet.decode = lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True))

    @classmethod
    async def connect(cls, actors: Sequence[Any], **kw: Any) -> FrontDoor:
        """Waits for every actor's ``info()`` (model loaded), then builds the front door."""
        infos = await asyncio.gather(*(a.info.remote() for a in actors))
        return cls(list(zip(actors, infos, strict=True)), **kw)

    def start(self) -> None:
        """Connects to the fleet and starts its monitor (and the adapters' periodic sync)
        on the running loop, and, given ``find_replicas``, the watch for replicas joining
        and leaving."""
        self.fleet.start()
        if self.membership is not None:
            self.membership.start()
        wanted = self.lora_resync_s > 0 or self.loras.shared is not None
        if wanted and self._resync is None:
            self._resync = asyncio.get_running_loop().create_task(self._resync_loras())

    async def close(self) -> None:
        if self.flow is not None:
            self.flow.close()
        if self._resync is not None:
            self._resync.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._resync
        if self.membership is not None:
            await self.membership.close()
        await self.fleet.close()

    # -- parts ---------------------------------------------------------------------------------
    @property
    def policy(self) -> Policy:
        return self._services.policy

    @policy.setter
    def policy(self, policy: Policy) -> None:
        """Requests routed from now on use ``policy`` (runs under way keep theirs)."""
        self._arm_fetch(policy)
        self._services = dataclasses.replace(self._services, policy=policy)

    def _arm_fetch(self, policy: Policy) -> None:
        """With prefix fetch on, a kv policy may fetch between replicas with a plane."""
        if self.prefix_fetch and isinstance(policy, KVPolicy):
            policy.fetchable = self.fleet.fetch_endpoint

    @property
    def errors(self) -> Mapping[str, int]:
        """Every part's error counts by kind, summed (a read-only snapshot): what /metrics
        shows as ``kvroute:errors``. Each part counts in its own."""
        total: Counter[str] = Counter()
        for counts in self._error_counts:
            total.update(counts)
        return MappingProxyType(total)

    def add_error_counts(self, counts: Counter[str]) -> None:
        """Another part's error counts (the HTTP layer's), summed into :attr:`errors`."""
        if all(c is not counts for c in self._error_counts):
            self._error_counts.append(counts)

    # -- requests ----------------------------------------------------------------------------
    def run(
        self,
        ticket: Ticket,
        tenant: Tenant,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        request_salt: str | None = None,
        request_id: str | None = None,
        lora: Adapter | None = None,
        priority: int = 0,
    ) -> RequestRun:
        """A request ready to :meth:`RequestRun.start`; it owns ``ticket`` from here on.
        ``lora``: the adapter it runs under (None: the base model); ``priority``: vLLM's
        (lower runs first), for flow control and the engine's scheduler. Raises
        :class:`~.quarantine.QueryOfDeathError` for a quarantined request."""
        fp = None
        adapter = None if lora is None else (lora.name, lora.path)
        if self.quarantine.entries:  # nothing to check against (the usual case): no hashing
            fp = fingerprint(prompt_token_ids, sampling, tenant.tenant_id, adapter)
            self.quarantine.check(fp)
        request_id = request_id or new_id()
        salt = tenant.salt_for(request_salt)
        fleet = self.fleet
        lora_name = lora.name if lora is not None else None
        hashes = (
            fleet.block_hashes(prompt_token_ids, salt)
            if lora is None
            else fleet.block_hashes(prompt_token_ids, salt, lora.name, lora.path)
        )
        view = RequestView(
            request_id=request_id,
            num_prompt_tokens=len(prompt_token_ids),
            block_hashes=hashes,
            block_size=fleet.hasher.block_size,
            token_ids=prompt_token_ids,
            max_tokens=sampling.max_tokens,
            reads_cache=sampling.prompt_logprobs is None,
            lora_name=lora_name,
        )
        request = GenerateRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling=sampling,
            cache_salt=salt,
            tenant=tenant.tenant_id,
            lora_name=lora_name,
            priority=priority,
        )
        if lora_name is None:
            return RequestRun(self._services, ticket, view, request, fp, adapter)
        loras = self.loras
        if not loras.serves(lora):  # unloaded while this request waited for its ticket
            raise not_found(lora_name)
        # Counted until the run ends (its ticket given back): an unload waits for it.
        loras.started(lora_name)
        series = self.metrics.lora_requests  # labels bounded: adapters churn over days
        label = lora_name if len(series.children) < MAX_ADAPTER_LABELS else OTHER_ADAPTER
        series.labels(lora_name if (lora_name,) in series.children else label).inc()
        release = self._services.release

        def release_lora(t: Ticket, n: int) -> None:
            release(t, n)
            loras.finished(lora_name)

        # Routed (and failed over) only among the replicas that hold the adapter.
        holding = HolderReplicas(self.fleet, loras, lora_name)
        services = dataclasses.replace(self._services, replicas=holding, release=release_lora)
        return RequestRun(services, ticket, view, request, fp, adapter)

    # -- LoRA adapters -----------------------------------------------------------------------
    async def _prepare_replica(self, actor: Any, info: ReplicaInfo) -> None:
        """Before a replica that joins or restarts is routed to: the registered adapters on
        it (:meth:`LoRARegistry.sync`). Replicas without LoRA calls (``vllm serve``
        backends) and fleets without adapters need nothing. A new process holds nothing
        until its sync says so."""
        self.loras.drop_replica(info.replica_id)
        synced = len(self.loras) or self.loras.shared is not None
        if synced and hasattr(actor, "list_loras"):
            await self.loras.sync(actor, info.replica_id)

    async def _resync_loras(self) -> None:
        """Every ``lora_resync_s``: each live replica made to hold the registered adapters
        again (:meth:`LoRARegistry.resync`): one it could not take is retried, one it lost
        is put back, and it is routed for each once it holds it. With a shared registry,
        its version is also asked every ``LORA_POLL_S``: another front door's load or
        unload is seen here within about a second."""
        loras, every = self.loras, self.lora_resync_s
        tick = every if loras.shared is None else min(every or LORA_POLL_S, LORA_POLL_S)
        loop = asyncio.get_running_loop()
        due = loop.time() + every
        while True:
            await asyncio.sleep(tick)
            try:
                await loras.refresh()
                if every > 0 and loop.time() >= due:
                    due = loop.time() + every
                    await loras.resync(self._live_actors())
            except Exception:  # never let the pass die: the next one may succeed
                log.exception("the periodic LoRA adapter sync failed")

    def _live_actors(self) -> dict[str, Any]:
        fleet = self.fleet
        return {
            rid: fleet.replicas[rid].actor
            for rid in fleet.alive()
            if hasattr(fleet.replicas[rid].actor, "list_loras")
        }

    async def load_lora(self, name: str, path: str) -> Adapter:
        """``POST /v1/load_lora_adapter``: on every live replica, then routable by name."""
        return await self.loras.load(name, path, self._live_actors())

    async def unload_lora(self, name: str) -> None:
        """``POST /v1/unload_lora_adapter``: no new request may name it; this front door's
        requests on it end first; then every replica drops it."""
        await self.loras.unload(name, self._live_actors())

    async def add_replica(self, actor: Any) -> str:
        """A replica that joins the running fleet (scale-up): it holds every registered
        adapter before it is routed to. Returns its id."""
        return await self.fleet.join(actor)

    def route(self, view: RequestView, candidates: list[str], now: float) -> str:
        """The policy's choice, counted in /metrics with its reason (as a run routes)."""
        return self._services.route(view, candidates, now).replica
