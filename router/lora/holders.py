"""The fleet as a request under one LoRA adapter sees it: the adapter's holders only.

Split out of :mod:`.registry`: a view the front door puts between a request's run and the
fleet (:class:`HolderReplicas`), asking the registry at each routing which replicas hold
the adapter.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..backends.connection import HttpReplicaConnection
    from ..fleet.replica_connection import ReplicaConnection
    from ..fleet.request_run import Replicas
    from .registry import LoRARegistry

__all__ = ["HolderReplicas"]


class HolderReplicas:
    """The fleet as a request under one adapter sees it: only the replicas that hold the
    adapter are routable (asked at each routing, failover included). The rest of
    :class:`~.request_run.Replicas` is the fleet's own."""

    __slots__ = ("_fleet", "_name", "_registry")

    def __init__(self, fleet: Replicas, registry: LoRARegistry, name: str) -> None:
        self._fleet, self._registry, self._name = fleet, registry, name

    def routable(self, exclude: Collection[str] = ()) -> list[str]:
        held = self._registry.holders(self._name)
        return [rid for rid in self._fleet.routable(exclude) if rid in held]

    def connection(self, rid: str) -> ReplicaConnection | HttpReplicaConnection:
        return self._fleet.connection(rid)

    def fail(self, rid: str) -> None:
        self._fleet.fail(rid)

    def mark_routed(self, rid: str) -> None:
        self._fleet.mark_routed(rid)

    @property
    def split_roles(self) -> bool:
        return self._fleet.split_roles

    def role(self, rid: str) -> str:
        return self._fleet.role(rid)

    def fetch_endpoint(self, rid: str) -> str:  # the source need not hold the adapter
        return self._fleet.fetch_endpoint(rid)
