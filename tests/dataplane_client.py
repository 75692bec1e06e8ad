"""Talking to a replica's data plane from a test, as a front door does."""

from __future__ import annotations

from typing import Any

from kvroute.events.replica_api import GenerateDelta, GenerateRequest, ReplicaInfo
from kvroute.router.fleet.replica_connection import ReplicaConnection


async def connect(replica: Any) -> ReplicaConnection:
    """A connection to ``replica`` (an actor handle, a ReplicaServer or its ReplicaInfo) on
    the running loop; close it when done."""
    if isinstance(replica, ReplicaInfo):
        info = replica
    elif hasattr(replica, "info") and hasattr(replica.info, "remote"):
        info = await replica.info.remote()
    else:
        info = replica.info()
    return ReplicaConnection(
        info.replica_id, info.data_endpoint, info.incarnation, "test", lambda *_: None
    )


async def collect(replica: Any, request: GenerateRequest) -> list[GenerateDelta]:
    """Every delta of one request, on a connection of its own."""
    conn = await connect(replica)
    try:
        return [d async for d in conn.stream(request)]
    finally:
        conn.close()
