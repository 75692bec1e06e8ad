"""ZeroMQ socket options of the data plane (:mod:`kvroute.events.dataplane_wire`): both ends,
the replica's ROUTER and each front door's DEALER, set the same ones."""

from __future__ import annotations

import zmq

# Messages queued per peer before ZeroMQ refuses more: a front door that stopped reading
# for this many steps is stuck, and its requests are aborted rather than buffered forever.
HWM = 100_000


def configure_socket(sock: zmq.Socket) -> None:
    """Options both ends share: no lingering on close, ZMTP heartbeats (a peer whose host
    vanished without a FIN is noticed in seconds), a high water mark that is never hit by a
    peer that reads."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
    sock.setsockopt(zmq.HEARTBEAT_TTL, 6000)
