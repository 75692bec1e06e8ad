"""What the subscriber keeps per publisher, and what it hands its consumer.

Split out of :mod:`.subscriber` so that its parts (the socket loop, gap recovery, the
replay client) share these types without importing the subscriber itself:
:class:`ReplicaBatch` (one delivery), :class:`ReplicaStats` (counters per replica) and
:class:`Subscription` (one followed publisher: its sockets and where its stream stands).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import zmq

from ..wire import EventBatch

EVENTS, POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: no IntFlag per question

Source = Literal["live", "replay", "snapshot", "reset"]


@dataclass(slots=True)
class ReplicaBatch:
    """One delivery: apply ``batch`` to ``replica_id``'s state, in delivery order."""

    replica_id: str
    seq: int
    batch: EventBatch
    source: Source


@dataclass(slots=True)
class ReplicaStats:
    received: int = 0  # live messages read
    delivered: int = 0  # batches handed to the consumer (all sources)
    gaps: int = 0
    replays: int = 0  # replay requests sent
    snapshots: int = 0  # snapshot requests sent
    restarts: int = 0
    resets: int = 0  # times the replica's state was dropped (restart or unrecoverable gap)
    malformed: int = 0
    request_timeouts: int = 0
    last_seq: int = -1
    last_heard: float = 0.0  # time.monotonic() of the newest live message


@dataclass
class Subscription:
    """One publisher this subscriber follows: its sockets and where its stream stands."""

    replica_id: str
    endpoint: str
    replay_endpoint: str | None
    topic: bytes
    sub: zmq.Socket
    dealer: zmq.Socket | None = None
    stats: ReplicaStats = field(default_factory=ReplicaStats)
    last_seq: int = -1
    syncing: Literal["", "replay", "snapshot"] = ""
    deadline: float = 0.0
    attempts: int = 0
    pending: list[tuple[int, EventBatch | None]] = field(default_factory=list)
    reply: list[tuple[int, bytes]] = field(default_factory=list)
    snapshot_supported: bool = True
    warned_malformed: bool = False
    live_seq: int | None = None  # newest seq read on the live socket
    monitor: zmq.Socket | None = None
    was_disconnected: bool = False
