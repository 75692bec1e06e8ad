"""The transport of the event stream: ZeroMQ sockets and the threads that drive them.

:mod:`.publisher` (:class:`ZmqEventPublisher`: one engine's batches on PUB, replay and
snapshots on ROUTER, a bounded queue drained by its own thread), :mod:`.subscriber`
(:class:`ZmqEventSubscriber`: every replica's stream in order, gaps replayed, restarts and
snapshots applied; its own thread or an asyncio loop; its parts in :mod:`.subscription`,
:mod:`.subscriber_loop`, :mod:`.subscriber_recovery` and :mod:`.subscriber_replay`),
:mod:`.sockets` (the data plane's socket options, both ends) and :mod:`.threads` (a pipe
waker and OS thread names, shared with the replica's data-plane and engine threads).

What they carry is the contract, one package up (:mod:`kvroute.events`): this package
imports it; it never imports this one.
"""

from .publisher import ZmqEventPublisher
from .subscriber import ReplicaBatch, ReplicaStats, ZmqEventSubscriber

__all__ = ["ReplicaBatch", "ReplicaStats", "ZmqEventPublisher", "ZmqEventSubscriber"]
