"""FrontDoor: one router's runtime -- its fleet, admission, policy and quarantine -- and
where a request becomes a :class:`RequestRun`.

One object per router process, used from one asyncio loop (the HTTP server's). It holds
what changes together in its own parts and only wires them:

- :class:`~.fleet.Fleet`: replicas, discovery, data-plane connections, health, and the
  feeds routing reads (KV events into the prefix index, load reports into the load view).
- :class:`~.admission.Admission`: tenant limits, fair share, the in-flight budget and its
  waiters. The HTTP layer admits a request before it reads its body.
- the :class:`~.policy.Policy`, which picks a replica for each request from the fleet's
  index and load view;
- :class:`~.quarantine.Quarantine`: requests that may have killed a replica, refused.
- :class:`~.request_run.RequestRun`: one request from routing to its end (failover
  included), made by :meth:`FrontDoor.run`.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import Sequence
from typing import Any

from kvroute.events.replica_api import GenerateRequest, ReplicaInfo, SamplingParams

from .admission import Admission, Ticket
from .errors import new_id
from .fleet import Fleet, FleetMismatchError
from .metrics import FleetCollector, Metrics
from .policy import Policy, RequestView, make_policy
from .quarantine import Quarantine, fingerprint
from .request_run import RequestRun
from .tenants import Tenant

__all__ = ["FleetMismatchError", "FrontDoor"]

ADDED_LATENCY_WINDOW = 4096  # the latest requests whose added latency /metrics summarizes


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
    ) -> None:
        """Admission's limits: see :class:`Admission`; the intervals: see :class:`Fleet`."""
        self.counters: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.fleet = Fleet(
            replicas,
            errors=self.errors,
            monitor_interval_s=monitor_interval_s,
            load_interval_s=load_interval_s,
        )
        self.admission = Admission(
            max_in_flight,
            max_in_flight_per_tenant,
            admission_queue,
            admission_timeout_s,
            self.errors,
        )
        fleet = self.fleet
        self.policy: Policy = make_policy(
            policy, index=fleet.index, block_size=fleet.hasher.block_size, load=fleet.load
        )
        fleet.on_removed.append(lambda rid: self.policy.on_replica_removed(rid))
        self.quarantine = Quarantine(self.errors)
        self.added_latency: deque[float] = deque(maxlen=ADDED_LATENCY_WINDOW)
        self.metrics = Metrics()
        self.fleet_collector = FleetCollector(self)
        self.metrics.registry.register(self.fleet_collector)
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
        """Connects to the fleet and starts its monitor on the running loop."""
        self.fleet.start()

    async def close(self) -> None:
        await self.fleet.close()

    # -- requests ----------------------------------------------------------------------------
    def run(
        self,
        ticket: Ticket,
        tenant: Tenant,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        request_salt: str | None = None,
        request_id: str | None = None,
    ) -> RequestRun:
        """A request ready to :meth:`RequestRun.start`; it owns ``ticket`` from here on.
        Raises :class:`~.quarantine.QueryOfDeathError` for a quarantined request."""
        fp = None
        if self.quarantine:  # nothing to check against (the usual case): no hashing
            fp = fingerprint(prompt_token_ids, sampling)
            self.quarantine.check(fp)
        request_id = request_id or new_id()
        salt = tenant.salt_for(request_salt)
        fleet = self.fleet
        view = RequestView(
            request_id=request_id,
            num_prompt_tokens=len(prompt_token_ids),
            block_hashes=fleet.block_hashes(prompt_token_ids, salt),
            block_size=fleet.hasher.block_size,
            token_ids=prompt_token_ids,
            max_tokens=sampling.max_tokens,
            reads_cache=sampling.prompt_logprobs is None,
        )
        request = GenerateRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling=sampling,
            cache_salt=salt,
            tenant=tenant.tenant_id,
        )
        return RequestRun(self, ticket, view, request, fp)

    def route(self, view: RequestView, candidates: list[str], now: float) -> str:
        """The policy's choice, counted in /metrics with its reason."""
        decision = self.policy.route(view, candidates, now)
        self.metrics.routing.labels(decision.replica, decision.reason).inc()
        return decision.replica

    def time_first_delta(self, router_ttft_s: float, replica_ttft_s: float) -> dict[str, float]:
        """One streamed request's TTFT at the front door and at its replica; their
        difference (what routing, the data plane and HTTP added) goes to /metrics."""
        added = router_ttft_s - replica_ttft_s
        self.added_latency.append(added)
        self.metrics.added.observe(max(added, 0.0))
        return {
            "replica_ttft_s": round(replica_ttft_s, 6),
            "router_ttft_s": round(router_ttft_s, 6),
        }
