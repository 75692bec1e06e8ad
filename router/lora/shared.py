"""One LoRA registry for every front door of a fleet: a named Ray actor (issue 37).

Why: ``kvroute serve --routers N`` runs N front doors over the same replicas, and each
one's periodic resync makes a replica hold what *its* registry lists. With a registry per
front door, an adapter loaded through one was removed from every replica by another's
next pass. Here the fleet's truth is one actor, ``kvroute-lora-registry`` in the fleet's
Ray namespace (one fleet per namespace, as the replicas' names ``replica-r<i>`` are),
created by whichever front door starts first (``get_if_exists``). On a cluster it is
detached, like the replicas: it outlives a front door's restart, and ``kvroute stop``
ends it with them; on ``kvroute serve``'s own local Ray it lives as long as that Ray.

Where it runs, and its loss: on the node of the front door that created it (soft
affinity: usually the head, which a fleet does not lose without its front door), never
on a replica's worker by chance. If its node dies anyway, Ray restarts it elsewhere,
empty, under a new ``epoch``: the first front door that polls it finds it unseeded and
seeds it with its own copy (:meth:`SharedLoRAs.seed`), so no sync strips the replicas of
what the fleet had loaded. Loads and unloads pending at the loss end as they would have
(``end_load`` registers, ``end_unload`` only frees the name).

What it holds: name -> (folder, created), the replicas that took each adapter when it was
loaded (a front door that learns of it starts routing there; its own syncs keep its copy
true after), the names being loaded or unloaded (``pending``: no front door's sync adds
or removes those), and a version, bumped on every change. It decides, one call at a time
(a Ray actor runs its calls in order): a load or unload *begins* here (refused when the
name is taken or busy), the receiving front door then makes the replicas' calls and
*ends* it here. A pending name whose front door died is forgotten after its lease.

An unload waits for every front door (:meth:`SharedLoRAs.drained`): each one's poll says
which version it has copied and which unregistered adapters it still has requests on, so
the unloading front door takes an adapter off the replicas only once every front door
seen in the last ``DOOR_TTL_S`` has copied the unload (it routes no new request there)
and has none of its requests left on it (none fails on a replica that lost it). A front
door that stopped polling is not waited for.

A front door's sync removes an adapter a replica holds but the registry does not list
only through :meth:`SharedLoRAs.remove_unlisted`, which checks and removes in one call, so
it can never race a load that another front door has just begun.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

LORA_REGISTRY_ACTOR = "kvroute-lora-registry"
LOAD_LEASE_S = 600.0  # a load's replicas' calls; past this its front door is taken as dead
REMOVE_TIMEOUT_S = 10.0  # the registry waits this long at most for one replica's removal
LORA_POLL_S = 1.0  # how often each front door polls the registry (its changes seen)
DOOR_TTL_S = 5 * LORA_POLL_S  # a front door silent this long is no longer waited for


@dataclass(frozen=True, slots=True)
class SharedView:
    """The registry as one front door copies it (``version``: to ask for changes only)."""

    version: int
    epoch: str  # one per actor process: a restarted registry is a new one
    seeded: bool  # False: restarted empty, waiting for a front door's copy
    adapters: dict[str, tuple[str, int]]  # name -> (folder, created)
    holders: dict[str, frozenset[str]]  # name -> the replicas that took it at its load
    pending: frozenset[str] = field(default_factory=frozenset)


class SharedLoRAs:
    """The actor's state and calls (made an actor by :func:`shared_registry`)."""

    def __init__(self) -> None:
        self.epoch = uuid.uuid4().hex
        self.version = 0
        self.seeded = False
        self.adapters: dict[str, tuple[str, int]] = {}
        self.holders: dict[str, frozenset[str]] = {}
        self.pending: dict[str, float] = {}  # name -> when its lease ends (monotonic)
        self.unloads: dict[str, int] = {}  # name -> the version its unload began at
        # front door -> (its last poll, monotonic; the version it had copied; the
        # unregistered adapters it still had requests on)
        self.doors: dict[str, tuple[float, int, frozenset[str]]] = {}

    def _changed(self) -> None:
        self.version += 1

    def _expire(self) -> None:
        now = time.monotonic()
        dead = [n for n, until in self.pending.items() if until < now]
        for name in dead:
            del self.pending[name]
            self.unloads.pop(name, None)  # its unloader died: nothing waits on drained()
        if dead:
            self._changed()

    def view(
        self, known: int = -1, epoch: str = "", door: str = "", busy: frozenset[str] = frozenset()
    ) -> SharedView | None:
        """The registry, or None when ``known`` is its version already in this ``epoch``
        (a cheap poll). ``door``: the polling front door, whose copy is at ``known`` and
        which still has requests on the unregistered adapters ``busy`` (:meth:`drained`)."""
        self._expire()
        if door:
            copied = known if epoch == self.epoch else -1
            self.doors[door] = (time.monotonic(), copied, frozenset(busy))
        if known == self.version and epoch == self.epoch:
            return None
        return SharedView(self.version, self.epoch, self.seeded, dict(self.adapters),
                          dict(self.holders), frozenset(self.pending))  # fmt: skip

    def seed(self, adapters: dict[str, str], holders: dict[str, frozenset[str]]) -> SharedView:
        """The first front door's start: the adapters the replicas hold (``--lora-modules``);
        after the actor's restart, the first poller's copy. Later ones (a front door's
        restart included) get what the registry holds, not what they found."""
        if not self.seeded:
            self.seeded = True
            now = int(time.time())
            self.adapters = {n: (p, now) for n, p in adapters.items()}
            self.holders = {n: frozenset(holders.get(n, ())) for n in adapters}
            self._changed()
        view = self.view()
        assert view is not None
        return view

    def begin_load(self, name: str, lease_s: float = LOAD_LEASE_S) -> str | None:
        """``name`` reserved for a load (None), or why not: "loaded" or "busy"."""
        self._expire()
        if name in self.adapters:
            return "loaded"
        if name in self.pending:
            return "busy"
        self.pending[name] = time.monotonic() + lease_s
        self._changed()
        return None

    def end_load(self, name: str, path: str | None, holders: frozenset[str] = frozenset()) -> int:
        """The load's end: registered at ``path`` (None: it failed, the name is free)."""
        self.pending.pop(name, None)
        if path is not None:
            self.adapters[name] = (path, int(time.time()))
            self.holders[name] = frozenset(holders)
        self._changed()
        return self.version

    def begin_unload(self, name: str, lease_s: float) -> str | None:
        """``name`` unregistered (no front door routes it from its next refresh) and held
        pending while its receiver waits for its requests and unloads it (None), or why
        not: "unknown" or "busy"."""
        self._expire()
        if name in self.pending:
            return "busy"
        if name not in self.adapters:
            return "unknown"
        del self.adapters[name]
        self.holders.pop(name, None)
        self.pending[name] = time.monotonic() + lease_s
        self._changed()
        self.unloads[name] = self.version
        return None

    def drained(self, name: str) -> bool:
        """Whether every front door that polled within ``DOOR_TTL_S`` has copied the
        unload of ``name`` and has no request left on it: the replicas may drop it."""
        began = self.unloads.get(name)
        if began is None:
            return True
        now = time.monotonic()
        for door, (seen, copied, busy) in list(self.doors.items()):
            if now - seen > DOOR_TTL_S:
                del self.doors[door]  # stopped polling: died or shut down
            elif copied < began or name in busy:
                return False
        return True

    def end_unload(self, name: str) -> int:
        self.pending.pop(name, None)
        self.unloads.pop(name, None)
        self._changed()
        return self.version

    def listed(self, name: str, path: str) -> bool:
        """Whether ``name`` is registered at ``path`` (a sync's check after it added it)."""
        return self.adapters.get(name, (None,))[0] == path

    def remove_unlisted(self, replica: Any, name: str, path: str) -> bool:
        """Removes ``name`` from ``replica`` if the registry does not list it at ``path``
        and no load or unload of it is under way; True when it did. In this one call, so
        no load can begin between the check and the removal."""
        import ray

        self._expire()
        if name in self.pending or self.listed(name, path):
            return False
        ray.get(replica.remove_lora.remote(name), timeout=REMOVE_TIMEOUT_S)
        return True


def shared_registry(detached: bool, name: str = LORA_REGISTRY_ACTOR) -> Any:
    """The fleet's registry actor in the driver's namespace, created if none runs yet, on
    this process's node (soft: elsewhere if it cannot be), restarted if its node dies.
    ``detached``: it outlives this process (a cluster's fleet; ``kvroute stop`` ends it)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    extra: dict[str, Any] = {"lifetime": "detached"} if detached else {}
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
    actor_cls = ray.remote(SharedLoRAs)
    return actor_cls.options(  # type: ignore[attr-defined]
        name=name, get_if_exists=True, num_cpus=0, max_concurrency=1, max_restarts=-1,
        max_task_retries=0, scheduling_strategy=here, **extra,
    ).remote()  # fmt: skip
