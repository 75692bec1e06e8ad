"""The fleet's LoRA adapters as one front door knows them: name -> folder, on every replica.

Several front doors over one fleet share one registry, a Ray actor (:mod:`.lora_shared`):
each :class:`LoRARegistry` is then a copy of it for the hot path (routing, ``/v1/models``,
404s), refreshed when its version moves on (polled every second by the front door, and
at once after this front door's own load or unload, and before each sync). The actor
decides loads and unloads (one per name at a time); this front door makes the replicas'
calls and reports the result. Without the actor (``vllm serve`` backends, tests), the
registry here is the truth, as below.

Why a registry in the router, and not only in each engine:
- A replica that joins later (scale-up, a Ray restart, a reconstructed actor) starts with
  its ``--lora-modules`` only; adapters loaded since through the API would be missing
  there, and requests naming them would fail on it (peers' bug, aibrix#1095). The
  registry is the fleet's truth: :meth:`LoRARegistry.sync` makes a replica hold exactly
  the registered adapters, and the fleet calls it before the replica is routed to.
- The router hashes an adapter request's blocks itself, and under ``sha256_cbor_tagged``
  the adapter's folder is in every block's hash: the path kept here is the one the
  replicas registered (their answer to ``add_lora``), never the one a client typed.
- The registry knows which replicas hold each adapter (its holders), and a request naming
  an adapter is routed only among them (:class:`HolderReplicas`, before any policy sees
  the candidates); none live: a 503 that names the adapter, never a replica without it.
  Holders come from what each replica answered: load's replicas that took it, sync's
  successes (a failed one is left out, the replica still serves the rest), unload (none).
  A replica that joins or restarts holds nothing until its sync says otherwise; one that
  fails is not unlisted (it is unroutable anyway, and the same process that comes back
  still holds them). :meth:`LoRARegistry.resync` (the front door's periodic pass) retries
  what a replica lacks and repairs one that lost an adapter behind the router's back.
- Load adds the adapter on every live replica *before* the registry names it, so no
  request is routed to a replica that lacks it; unload takes the name out of the registry
  first (new requests get a 404), waits until this front door's requests on it have ended,
  and under a shared registry until every other front door has copied the unload and
  ended its own (:meth:`~.lora_shared.SharedLoRAs.drained`; all within ``unload_wait_s``),
  then unregisters it on the replicas. Requests of other adapters and of the base model
  are never touched.

Which tenant may use which adapter is the tenants file's (:mod:`.tenants`); an adapter a
tenant may not use is, to that tenant, an adapter that does not exist (same 404).

The adapter record, the fleet's adapters at start (:class:`FleetLoRAs`) and the registry's
answers (404s, refusals, refused loads) are :mod:`.adapter`; the holders-only view of the
fleet a request under an adapter routes over, :mod:`.holders` (both re-exported here).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Collection, Mapping
from typing import TYPE_CHECKING, Any

from ..api.errors import one_line
from ..fleet.tenants import Tenant
from .adapter import (
    Adapter,
    AdapterConflictError,
    FleetLoRAs,
    check_load,
    not_found,
    not_loaded,
    refusal,
    taken,
    unknown,
)
from .holders import HolderReplicas
from .shared import LORA_POLL_S

if TYPE_CHECKING:
    from .shared import SharedView

__all__ = [
    "RESYNC_TIMEOUT_S",
    "UNLOAD_WAIT_S",
    "Adapter",
    "AdapterConflictError",
    "FleetLoRAs",
    "HolderReplicas",
    "LoRARegistry",
    "fleet_adapters",
    "not_found",
    "prepare_fleet",
]

log = logging.getLogger(__name__)

UNLOAD_WAIT_S = 300.0  # longest an unload waits for this front door's requests on it
RESYNC_TIMEOUT_S = 60.0  # longest one replica's periodic sync may hold the registry


class LoRARegistry:
    """Registered adapters, their requests in flight here, and the calls that put them on
    replicas (the module docstring). Used from the front door's event loop."""

    def __init__(
        self,
        base_names: Collection[str],
        adapters: Mapping[str, str] | None = None,
        holders: Mapping[str, Collection[str]] | None = None,
        *,
        unload_wait_s: float = UNLOAD_WAIT_S,
        shared: Any = None,
    ) -> None:
        """``base_names``: what ``model`` may say for the base model (no adapter may take
        one). ``adapters``: name -> folder, as the replicas registered them; ``holders``:
        name -> the replica ids known to hold it (an adapter left out: none yet).
        ``shared``: the fleet's registry actor (:mod:`.lora_shared`), whose view this one
        copies (:meth:`refresh`); None: this front door's own registry is the truth."""
        self.base_names = frozenset(base_names)
        self.unload_wait_s = unload_wait_s
        self.shared = shared
        self.version = -1  # the shared registry's, as last copied
        self.door_id = uuid.uuid4().hex  # this front door, to the shared registry
        self.epoch = ""  # ... and which registry process it was (a restart is a new one)
        self._pending: frozenset[str] = frozenset()  # being (un)loaded: no sync touches them
        now = int(time.time())
        self._adapters: dict[str, Adapter] = {
            name: Adapter(name, path, now) for name, path in (adapters or {}).items()
        }
        held = holders or {}
        self._holders: dict[str, set[str]] = {n: set(held.get(n, ())) for n in self._adapters}
        self._refused: set[tuple[str, str]] = set()  # (replica, adapter) logged as refused
        self.in_flight: Counter[str] = Counter()  # this front door's requests, by adapter
        self.errors: Counter[str] = Counter()  # sync failures (summed into /metrics)
        # Loads and unloads run side by side, one at a time per name (``_busy``: a second
        # call for a name under way is answered at once); their replica calls (``_calls``
        # of them running) never overlap a sync, which compares replicas with the registry
        # and holds ``_sync_lock`` while it runs.
        self._busy: set[str] = set()
        self._calls = 0
        self._sync_lock = asyncio.Lock()
        self._idle: dict[str, asyncio.Event] = {}  # set when an adapter's requests end

    # -- reading ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._adapters)

    def paths(self) -> dict[str, str]:
        return {a.name: a.path for a in self._adapters.values()}

    def serves(self, adapter: Adapter) -> bool:
        """Whether ``adapter`` (resolved earlier) is still registered, at the same folder."""
        mine = self._adapters.get(adapter.name)
        return mine is not None and mine.path == adapter.path

    def resolve(self, model: str, tenant: Tenant) -> Adapter | None:
        """The adapter ``model`` names, when it is registered and ``tenant`` may use it."""
        adapter = self._adapters.get(model)
        if adapter is None or not tenant.may_use(model):
            return None
        return adapter

    def visible(self, tenant: Tenant) -> list[Adapter]:
        """The adapters ``tenant`` may use, oldest first (``/v1/models``)."""
        return [a for a in self._adapters.values() if tenant.may_use(a.name)]

    # -- holders ---------------------------------------------------------------------------
    def holders(self, name: str) -> frozenset[str]:
        """The replica ids that hold ``name`` (alive or not); empty for an unknown name."""
        return frozenset(self._holders.get(name, ()))

    def holder_map(self) -> dict[str, frozenset[str]]:
        return {name: frozenset(held) for name, held in self._holders.items()}

    def holder_counts(self, alive: Collection[str]) -> dict[str, int]:
        """Per adapter, how many of the ``alive`` replicas hold it (/metrics)."""
        return {name: len(held.intersection(alive)) for name, held in self._holders.items()}

    def drop_replica(self, rid: str) -> None:
        """``rid`` holds nothing (a new process: its sync says what it holds)."""
        for held in self._holders.values():
            held.discard(rid)
        self._refused = {(r, n) for r, n in self._refused if r != rid}

    def _record(self, name: str, path: str, rid: str, held: bool) -> None:
        """What a replica answered for ``name`` at ``path``; ignored when the registry
        changed meanwhile (unloaded, or loaded again from elsewhere)."""
        adapter = self._adapters.get(name)
        if adapter is None or adapter.path != path:
            return
        holders = self._holders.setdefault(name, set())
        (holders.add if held else holders.discard)(rid)

    # -- the shared registry ---------------------------------------------------------------
    async def refresh(self) -> bool:
        """Copies the shared registry when its version moved on (True when it did)."""
        if self.shared is None:
            return False
        busy = frozenset(n for n, c in self.in_flight.items() if c and n not in self._adapters)
        view = await self.shared.view.remote(self.version, self.epoch, self.door_id, busy)
        if view is None:
            return False
        if not view.seeded:  # restarted empty (its node died): this copy is the fleet's
            view = await self.shared.seed.remote(self.paths(), self.holder_map())
            log.warning("the shared LoRA registry came back empty; seeded it with %d "
                        "adapter(s)", len(view.adapters))  # fmt: skip
        self.apply(view)
        return True

    def apply(self, view: SharedView) -> None:
        """``view`` as this front door's copy: an adapter new here (or at a new folder)
        starts with the holders its load recorded, one known here keeps this front door's
        own; a pending one keeps its holders (its requests here may still fail over).
        A view older than the copy (two refreshes' answers crossing) is ignored."""
        if view.epoch == self.epoch and view.version <= self.version:
            return
        adapters: dict[str, Adapter] = {}
        for name, (path, created) in view.adapters.items():
            mine = self._adapters.get(name)
            if mine is None or mine.path != path:
                mine = Adapter(name, path, created)
                self._holders[name] = set(view.holders.get(name, ()))
            adapters[name] = mine
        self._adapters = adapters
        for name in [n for n in self._holders if n not in adapters and n not in view.pending]:
            del self._holders[name]
        self._pending = view.pending
        self.version, self.epoch = view.version, view.epoch

    async def _end_load(self, name: str, adapter: Adapter | None, took: Collection[str]) -> None:
        if self.shared is not None:
            path = adapter.path if adapter is not None else None
            await self.shared.end_load.remote(name, path, frozenset(took))
            await self.refresh()

    # -- requests in flight ----------------------------------------------------------------
    def started(self, name: str) -> None:
        self.in_flight[name] += 1

    def finished(self, name: str) -> None:
        left = self.in_flight[name] - 1
        if left > 0:
            self.in_flight[name] = left
            return
        del self.in_flight[name]
        idle = self._idle.get(name)
        if idle is not None:
            idle.set()

    # -- changes ---------------------------------------------------------------------------
    async def load(self, name: str, path: str, replicas: Mapping[str, Any]) -> Adapter:
        """Registers ``name`` on every replica of ``replicas`` (id -> actor), then here.
        Raises :class:`APIError` (400) naming the field when a replica refuses it; the
        replicas that took it then drop it again. A replica that does not answer is
        skipped (it gets the adapter from :meth:`sync` when it is back)."""
        check_load(name, path, self.base_names)
        async with self._name(name):
            why_not = "loaded" if name in self._adapters else None
            if self.shared is not None:  # the fleet's registry decides, not this copy
                why_not = await self.shared.begin_load.remote(name)
            if why_not is not None:
                raise taken(name, why_not)
            try:
                async with self._replica_calls():
                    adapter = await self._load(name, path, replicas)
            except BaseException:
                await asyncio.shield(self._end_load(name, None, ()))
                raise
            await self._end_load(name, adapter, self._holders[name])
            return adapter

    @contextlib.asynccontextmanager
    async def _name(self, name: str) -> AsyncIterator[None]:
        """``name`` is this call's while it runs: another load or unload of it is refused
        at once (400), never queued behind one that may wait minutes on a stream; calls
        for other names go on beside it."""
        if name in self._busy:
            raise taken(name, "busy")
        self._busy.add(name)
        try:
            yield
        finally:
            self._busy.discard(name)

    @contextlib.asynccontextmanager
    async def _replica_calls(self) -> AsyncIterator[None]:
        """A change's calls to the replicas: after any sync under way, and none begins
        until they end (:meth:`resync`)."""
        async with self._sync_lock:
            self._calls += 1
        try:
            yield
        finally:
            self._calls -= 1

    async def _load(self, name: str, path: str, replicas: Mapping[str, Any]) -> Adapter:
        """:meth:`load`'s calls to the replicas, once the name is this front door's."""
        rids = list(replicas)
        results = await asyncio.gather(
            *(replicas[r].add_lora.remote(name, path) for r in rids), return_exceptions=True
        )
        took = [r for r, res in zip(rids, results, strict=True) if isinstance(res, str)]
        refusals = [refusal(res) for res in results if isinstance(res, BaseException)]
        why = next((r for r in refusals if r is not None), None)
        paths = {res for res in results if isinstance(res, str)}
        if why is None and len(paths) > 1:
            why = f"replicas registered it under different paths: {sorted(paths)}"
        if why is not None or not took:
            await asyncio.gather(
                *(replicas[r].remove_lora.remote(name) for r in took), return_exceptions=True
            )
            raise not_loaded(name, why)
        for rid, res in zip(rids, results, strict=True):
            if isinstance(res, BaseException):
                self.errors["lora_load_failed"] += 1
                log.warning("replica %s did not take adapter %r: %r", rid, name, res)
        adapter = self._adapters[name] = Adapter(name, paths.pop(), int(time.time()))
        self._holders[name] = set(took)  # the others get it from a later sync
        log.info("LoRA adapter %r loaded from %s on %d replica(s)", name, path, len(took))
        return adapter

    async def unload(self, name: str, replicas: Mapping[str, Any]) -> None:
        """Takes ``name`` out of the registry (new requests: 404), waits for this front
        door's requests on it to end (at most ``unload_wait_s``), then unregisters it on
        every replica. An unknown name: :class:`APIError` 404 naming ``lora_name``."""
        async with self._name(name):
            why_not = None if name in self._adapters else "unknown"
            if self.shared is not None:  # pending there until its replicas dropped it
                lease = self.unload_wait_s + RESYNC_TIMEOUT_S * 2
                why_not = await self.shared.begin_unload.remote(name, lease)
            if why_not == "unknown":
                raise unknown(name)
            if why_not is not None:
                raise taken(name, why_not)
            self._adapters.pop(name, None)
            try:
                await self._unload(name, replicas)
            finally:
                if self.shared is not None:
                    await asyncio.shield(self.shared.end_unload.remote(name))
                    await self.refresh()

    async def _unload(self, name: str, replicas: Mapping[str, Any]) -> None:
        """:meth:`unload` once the name is out of the registry: the wait, the replicas."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.unload_wait_s
        if self.in_flight[name]:
            idle = self._idle[name] = asyncio.Event()
            try:
                await asyncio.wait_for(idle.wait(), self.unload_wait_s)
            except TimeoutError:
                log.warning(
                    "adapter %r: %d request(s) still running after %g s; unloading",
                    name, self.in_flight[name], self.unload_wait_s,
                )  # fmt: skip
            finally:
                self._idle.pop(name, None)
        if self.shared is not None:  # the other front doors: copied the unload, drained
            await self.refresh()  # copies the unload; the next poll reports it copied
            await self.refresh()
            while not await self.shared.drained.remote(name):
                if loop.time() >= deadline:
                    log.warning("adapter %r: other front doors still use it after %g s; "
                                "unloading", name, self.unload_wait_s)  # fmt: skip
                    break
                await asyncio.sleep(LORA_POLL_S / 4)
        self._holders.pop(name, None)  # only now: its requests' failovers needed them
        self._refused = {(r, n) for r, n in self._refused if n != name}
        async with self._replica_calls():
            results = await asyncio.gather(
                *(a.remove_lora.remote(name) for a in replicas.values()), return_exceptions=True
            )
        for rid, res in zip(replicas, results, strict=True):
            if isinstance(res, BaseException):  # it syncs when it is back
                self.errors["lora_unload_failed"] += 1
                log.warning("replica %s did not drop adapter %r: %r", rid, name, res)
        log.info("LoRA adapter %r unloaded", name)

    async def sync(self, actor: Any, rid: str) -> list[str]:
        """Makes a replica hold exactly the registered adapters (same names, same paths):
        what a replica that joins or comes back needs before it is routed to. A refusal is
        logged and counted, not raised: the replica still serves the base model and the
        adapters it took, and is a holder of those only. Returns the names it lacks.

        Under a shared registry: what it lists now, names being loaded or unloaded left
        alone, an unlisted one removed by the registry itself (it checks and removes in one
        call: no load begins between), and one added here that was unloaded meanwhile
        removed again (so no replica keeps an adapter another front door unloaded)."""
        await self.refresh()
        have: dict[str, str] = await actor.list_loras.remote()
        want = self.paths()
        for name, path in have.items():
            if name in self._busy or name in self._pending:  # its load or unload decides
                continue
            now = self._adapters.get(name)  # as of now: a load may have ended meanwhile
            if now is None or now.path != path:
                self._record(name, now.path if now else "", rid, False)  # before it goes
                if self.shared is not None:
                    await self.shared.remove_unlisted.remote(actor, name, path)
                else:
                    await actor.remove_lora.remote(name)
        lacking = []
        for name, path in want.items():
            if name in self._pending or name in self._busy or name not in self._adapters:
                continue
            if have.get(name) != path:
                try:
                    await actor.add_lora.remote(name, path)
                    shared = self.shared
                    if shared is not None and not await shared.listed.remote(name, path):
                        await shared.remove_unlisted.remote(actor, name, path)
                        continue
                except Exception as exc:
                    self.errors["lora_sync_failed"] += 1
                    self._record(name, path, rid, False)
                    lacking.append(name)
                    first = (rid, name) not in self._refused  # a pass retries it: log once
                    self._refused.add((rid, name))
                    log.log(
                        logging.ERROR if first else logging.DEBUG,
                        "replica %s cannot take adapter %r (not routed there): %s",
                        rid, name, refusal(exc) or one_line(repr(exc)),
                    )  # fmt: skip
                    continue
            self._refused.discard((rid, name))
            self._record(name, path, rid, True)
        log.info("replica %s holds %d of the fleet's %d adapter(s)",
                 rid, len(want) - len(lacking), len(want))  # fmt: skip
        return lacking

    async def resync(
        self, replicas: Mapping[str, Any], timeout_s: float = RESYNC_TIMEOUT_S
    ) -> None:
        """:meth:`sync` on each of ``replicas`` (id -> actor): the periodic pass that retries
        an adapter a replica could not take, and puts back one it lost. One replica at a
        time under the lock (a load or unload changes what sync compares against), so an
        admin call waits one replica's sync at most; the pass stops while one runs."""
        for rid, actor in replicas.items():
            if self._calls or not (self._adapters or self.shared is not None):
                return
            async with self._sync_lock:
                if self._calls:  # a change got its turn first
                    return
                try:
                    await asyncio.wait_for(self.sync(actor, rid), timeout_s)
                except Exception as exc:  # a dying replica: the fleet's monitor sees it
                    self.errors["lora_resync_failed"] += 1
                    log.warning("replica %s: adapter sync failed: %r", rid, exc)


async def fleet_adapters(actors: Mapping[str, Any]) -> dict[str, str]:
    """The adapters the replicas hold at start (their ``--lora-modules``), as one map;
    :class:`AdapterConflictError` when two replicas hold one name under different folders."""
    lists = await asyncio.gather(*(a.list_loras.remote() for a in actors.values()))
    out: dict[str, str] = {}
    for rid, held in zip(actors, lists, strict=True):
        for name, path in held.items():
            if out.setdefault(name, path) != path:
                raise AdapterConflictError(
                    f"replica {rid} holds adapter {name!r} from {path}, another from "
                    f"{out[name]}: give every replica the same --lora-modules",
                    "lora_name",
                )
    return out


async def prepare_fleet(actors: Mapping[str, Any], shared: Any = None) -> FleetLoRAs:
    """At a front door's start: the adapters the replicas hold (:func:`fleet_adapters`),
    and every replica made to hold all of them (one restarted with fewer, or reused from
    an earlier ``kvroute serve``). A replica that refuses one is no holder of it.

    ``shared``: the fleet's registry actor. The first front door seeds it with what the
    replicas hold; a later one (or one restarted) takes what it lists instead, and makes
    the replicas hold that (an adapter unloaded while it was down stays unloaded)."""
    if not actors:
        return FleetLoRAs({}, {})
    adapters = await fleet_adapters(actors)
    registry = LoRARegistry((), adapters, shared=shared)
    if shared is not None:
        registry.apply(await shared.seed.remote(adapters, {n: frozenset(actors) for n in adapters}))
    if adapters or len(registry):
        for rid, actor in actors.items():
            await registry.sync(actor, rid)
    return FleetLoRAs(registry.paths(), registry.holder_map())
