"""The data plane: requests in, one message of outputs per engine step out, over ZeroMQ.

Why not Ray: a Ray streaming call costs an RPC, a serialization and an asyncio wake-up per
item, so a token per item put one front door's core at about one GPU's output. Here, as in
vLLM v1 (API server <-> EngineCore) and SGLang, a replica sends each front door *one*
message per engine step holding every delta of that front door's requests. Ray still
places, starts, restarts and discovers replicas (``ReplicaInfo.data_endpoint``); it carries
nothing per request and nothing per token.

Sockets: each replica binds one ROUTER (``data_endpoint``); each front door connects one
DEALER per replica, under a routing id of its own (its ``client_id``), so the replica
addresses its outputs to the front door that sent the requests. ROUTER_MANDATORY makes a
send to a front door that has gone fail loudly -- the replica then aborts that front door's
requests at once instead of computing them for nobody.

Frames, front door -> replica (DEALER):   [kind, payload]
    HELLO   b"H"  msgpack(Hello)                  first message of every connection
    ADD     b"A"  msgpack(GenerateRequest)
    ABORT   b"X"  msgpack(list of request ids)
Frames, replica -> front door (ROUTER):   [kind, payload]
    OUTPUTS   b"O"  msgpack(StepOutputs)            one per step that changed its requests
    HEARTBEAT b"H"  msgpack(Heartbeat)              answers HELLO; then whenever nothing else
                                                    went to that front door for a while
    LOAD      b"L"  msgpack(LoadReport)             the engine's load: at most every
                                                    LOAD_INTERVAL_S while it changes, and every
                                                    HEARTBEAT_INTERVAL_S while it does not
                                                    (to front doors of version 2 and later)
A front door that hears nothing from a replica for ``SILENCE_TIMEOUT_S`` (heartbeats come
from the replica's I/O thread, not its step loop, so a long step is no silence) or sees its
connection drop treats the replica as lost and fails its requests over. Load reports ride
here too, pushed: a front door polling each replica over Ray would pay an RPC per replica
per interval, hundreds a second on a large fleet.

This module is the contract (frames, messages, intervals): it opens no socket. The socket
options both ends set are :func:`kvroute.events.transport.sockets.configure_socket`.
"""

from __future__ import annotations

import msgspec

from .load import LoadReport
from .replica_api import GenerateDelta, GenerateRequest

__all__ = [
    "ABORT",
    "ADD",
    "HEARTBEAT",
    "HEARTBEAT_INTERVAL_S",
    "HELLO",
    "LOAD",
    "LOAD_INTERVAL_S",
    "OUTPUTS",
    "PROTOCOL_VERSION",
    "SILENCE_TIMEOUT_S",
    "Heartbeat",
    "Hello",
    "StepOutputs",
]

PROTOCOL_VERSION = 2  # 2: LOAD
HELLO, ADD, ABORT = b"H", b"A", b"X"
OUTPUTS, HEARTBEAT, LOAD = b"O", b"H", b"L"
HEARTBEAT_INTERVAL_S = 0.5
LOAD_INTERVAL_S = 0.1
SILENCE_TIMEOUT_S = 5.0  # ten heartbeats missed: the replica is gone (or hung)


class Hello(msgspec.Struct, array_like=True):
    """A front door introduces itself on a new connection."""

    client_id: str
    version: int = PROTOCOL_VERSION


class Heartbeat(msgspec.Struct, array_like=True):
    """The replica is alive (and which process it is: a new incarnation is a restart)."""

    incarnation: str
    version: int = PROTOCOL_VERSION


class StepOutputs(msgspec.Struct, array_like=True):
    """Every delta one engine step made for one front door's requests."""

    deltas: list[GenerateDelta]


# Encoders and decoders are reused: building one per message would cost more than the
# message itself.
encoder = msgspec.msgpack.Encoder()
decode_hello = msgspec.msgpack.Decoder(Hello).decode
decode_request = msgspec.msgpack.Decoder(GenerateRequest).decode
decode_abort = msgspec.msgpack.Decoder(list[str]).decode
decode_outputs = msgspec.msgpack.Decoder(StepOutputs).decode
decode_heartbeat = msgspec.msgpack.Decoder(Heartbeat).decode
decode_load = msgspec.msgpack.Decoder(LoadReport).decode
