"""The fleet's LoRA adapters as one front door knows them: name -> folder, on every replica.

Why a registry in the router, and not only in each engine:
- A replica that joins later (scale-up, a Ray restart, a reconstructed actor) starts with
  its ``--lora-modules`` only; adapters loaded since through the API would be missing
  there, and requests naming them would fail on it (peers' bug, aibrix#1095). The
  registry is the fleet's truth: :meth:`LoRARegistry.sync` makes a replica hold exactly
  the registered adapters, and the fleet calls it before the replica is routed to.
- The router hashes an adapter request's blocks itself, and under ``sha256_cbor_tagged``
  the adapter's folder is in every block's hash: the path kept here is the one the
  replicas registered (their answer to ``add_lora``), never the one a client typed.
- Load adds the adapter on every live replica *before* the registry names it, so no
  request is routed to a replica that lacks it; unload takes the name out of the registry
  first (new requests get a 404), waits until this front door's requests on it have ended
  (at most ``unload_wait_s``), then unregisters it on the replicas. Requests of other
  adapters and of the base model are never touched.

Which tenant may use which adapter is the tenants file's (:mod:`.tenants`); an adapter a
tenant may not use is, to that tenant, an adapter that does not exist (same 404).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import APIError, one_line
from .tenants import Tenant

log = logging.getLogger(__name__)

UNLOAD_WAIT_S = 300.0  # longest an unload waits for this front door's requests on it


@dataclass(frozen=True, slots=True)
class Adapter:
    """One registered adapter: its name (what ``model`` says), its folder as the replicas
    registered it (hashed into its blocks), when it was registered (``created``)."""

    name: str
    path: str
    created: int


class AdapterConflictError(ValueError):
    """A replica refused an adapter (the message says why; ``param`` names the field)."""

    def __init__(self, message: str, param: str = "lora_path") -> None:
        super().__init__(message)
        self.param = param


def not_found(model: str) -> APIError:
    """vLLM's answer to a model it does not serve (``NotFoundError``, ``param: model``);
    the same for an adapter the tenant may not use, so a 404 says nothing of others'."""
    return APIError(
        404,
        f"The model `{model[:100]}` does not exist.",
        "NotFoundError",
        "model",
        "model_not_found",
    )


def _refusal(exc: BaseException) -> str | None:
    """A replica's refusal (its engine's ValueError, through Ray) as one line; None for
    anything else (a replica that died or did not answer)."""
    cause = getattr(exc, "cause", None) or exc  # Ray's RayTaskError keeps the raised one
    if isinstance(cause, ValueError):
        return one_line(str(cause))
    return None


class LoRARegistry:
    """Registered adapters, their requests in flight here, and the calls that put them on
    replicas (the module docstring). Used from the front door's event loop."""

    def __init__(
        self,
        base_names: Collection[str],
        adapters: Mapping[str, str] | None = None,
        *,
        unload_wait_s: float = UNLOAD_WAIT_S,
    ) -> None:
        """``base_names``: what ``model`` may say for the base model (no adapter may take
        one). ``adapters``: name -> folder, as the replicas registered them."""
        self.base_names = frozenset(base_names)
        self.unload_wait_s = unload_wait_s
        now = int(time.time())
        self._adapters: dict[str, Adapter] = {
            name: Adapter(name, path, now) for name, path in (adapters or {}).items()
        }
        self.in_flight: Counter[str] = Counter()  # this front door's requests, by adapter
        self.errors: Counter[str] = Counter()  # sync failures (summed into /metrics)
        self._lock = asyncio.Lock()  # one load or unload at a time
        self._idle: dict[str, asyncio.Event] = {}  # set when an adapter's requests end

    # -- reading ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._adapters)

    def paths(self) -> dict[str, str]:
        return {a.name: a.path for a in self._adapters.values()}

    def resolve(self, model: str, tenant: Tenant) -> Adapter | None:
        """The adapter ``model`` names, when it is registered and ``tenant`` may use it."""
        adapter = self._adapters.get(model)
        if adapter is None or not tenant.may_use(model):
            return None
        return adapter

    def visible(self, tenant: Tenant) -> list[Adapter]:
        """The adapters ``tenant`` may use, oldest first (``/v1/models``)."""
        return [a for a in self._adapters.values() if tenant.may_use(a.name)]

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
        if not name:
            raise APIError(400, "`lora_name` must be given", "BadRequestError", "lora_name")
        if not path:
            raise APIError(400, "`lora_path` must be given", "BadRequestError", "lora_path")
        if name in self.base_names:
            raise APIError(
                400,
                f"`lora_name` {name[:100]!r} is the base model's name",
                "BadRequestError",
                "lora_name",
            )
        async with self._lock:
            if name in self._adapters:
                raise APIError(
                    400,
                    f"The lora adapter `{name[:100]}` has already been loaded.",
                    "BadRequestError",
                    "lora_name",
                )
            rids = list(replicas)
            results = await asyncio.gather(
                *(replicas[r].add_lora.remote(name, path) for r in rids), return_exceptions=True
            )
            took = [r for r, res in zip(rids, results, strict=True) if isinstance(res, str)]
            refusals = [_refusal(res) for res in results if isinstance(res, BaseException)]
            why = next((r for r in refusals if r is not None), None)
            paths = {res for res in results if isinstance(res, str)}
            if why is None and len(paths) > 1:
                why = f"replicas registered it under different paths: {sorted(paths)}"
            if why is not None or not took:
                await asyncio.gather(
                    *(replicas[r].remove_lora.remote(name) for r in took), return_exceptions=True
                )
                raise APIError(
                    400,
                    f"LoRA adapter `{name[:100]}` not loaded: {why or 'no replica answered'}",
                    "BadRequestError",
                    "lora_name" if why and "lora_name" in why else "lora_path",
                )
            for rid, res in zip(rids, results, strict=True):
                if isinstance(res, BaseException):
                    self.errors["lora_load_failed"] += 1
                    log.warning("replica %s did not take adapter %r: %r", rid, name, res)
            adapter = self._adapters[name] = Adapter(name, paths.pop(), int(time.time()))
            log.info("LoRA adapter %r loaded from %s on %d replica(s)", name, path, len(took))
            return adapter

    async def unload(self, name: str, replicas: Mapping[str, Any]) -> None:
        """Takes ``name`` out of the registry (new requests: 404), waits for this front
        door's requests on it to end (at most ``unload_wait_s``), then unregisters it on
        every replica. An unknown name: :class:`APIError` 404 naming ``lora_name``."""
        async with self._lock:
            if self._adapters.pop(name, None) is None:
                raise APIError(
                    404,
                    f"The lora adapter `{name[:100]}` cannot be found.",
                    "NotFoundError",
                    "lora_name",
                    "model_not_found",
                )
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
            results = await asyncio.gather(
                *(a.remove_lora.remote(name) for a in replicas.values()), return_exceptions=True
            )
            for rid, res in zip(replicas, results, strict=True):
                if isinstance(res, BaseException):  # it syncs when it is back
                    self.errors["lora_unload_failed"] += 1
                    log.warning("replica %s did not drop adapter %r: %r", rid, name, res)
            log.info("LoRA adapter %r unloaded", name)

    async def sync(self, actor: Any, rid: str) -> None:
        """Makes a replica hold exactly the registered adapters (same names, same paths):
        what a replica that joins or comes back needs before it is routed to. A refusal is
        logged and counted, not raised: the replica still serves the base model and the
        adapters it took."""
        have: dict[str, str] = await actor.list_loras.remote()
        want = self.paths()
        for name, path in have.items():
            if want.get(name) != path:
                await actor.remove_lora.remote(name)
        for name, path in want.items():
            if have.get(name) == path:
                continue
            try:
                await actor.add_lora.remote(name, path)
            except Exception as exc:
                self.errors["lora_sync_failed"] += 1
                log.error("replica %s cannot take adapter %r: %s", rid, name, one_line(str(exc)))
        log.info("replica %s holds the fleet's %d adapter(s)", rid, len(want))


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


async def prepare_fleet(actors: Mapping[str, Any]) -> dict[str, str]:
    """At a front door's start: the adapters the replicas hold (:func:`fleet_adapters`),
    and every replica made to hold all of them (one restarted with fewer, or reused from
    an earlier ``kvroute serve``). Returns the map the registry starts from."""
    if not actors:
        return {}
    adapters = await fleet_adapters(actors)
    if adapters:
        registry = LoRARegistry((), adapters)
        for rid, actor in actors.items():
            await registry.sync(actor, rid)
    return adapters
