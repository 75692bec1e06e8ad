"""The contract between replicas and routers, and (in :mod:`.transport`) what carries it.

Contract -- pure data and functions: no sockets, no threads, nothing started at import.
Both sides must agree on these, byte for byte:

- :mod:`.hashing` -- chained block hashes (``_chain``: its optional C loop)
- :mod:`.wire` -- KV-event structs and vLLM's msgpack wire format
- :mod:`.framing` -- the ZeroMQ frames around a batch: seq, replay, snapshot, end marker
- :mod:`.blockset` -- the block set an event stream implies
- :mod:`.translate` -- an engine's events re-hashed with the fleet's hash (token-id indexing)
- :mod:`.load` -- load reports and cost coefficients
- :mod:`.bounds` -- request bounds, checked by the front door and the engine alike
- :mod:`.replica_api` -- requests, deltas, sampling parameters, replica info, errors
- :mod:`.dataplane_wire` -- the data plane's frame kinds, messages and intervals
- :mod:`.kv_transfer` -- KV between replicas: a handoff's lease, its source, the transfer
  plane's messages

Transport -- :mod:`.transport`: the ZeroMQ publisher and subscriber of the event stream,
the data plane's socket options, and their threading aids. The data plane's two ends (a
replica's ``DataPlaneServer``, a front door's ``ReplicaConnection``) live in ``replica/``
and ``router/``, beside the engine and the front door they serve.

Process setup -- :mod:`.torch_wheels`: hides torch companion wheels that cannot load
(standard library only). It is neither contract nor transport, and importing this package
does not call it: the entry points do (``kvroute.replica``, ``kvroute.router``, the
``kvroute`` command, vLLM's engine-core main), before anything reads a model's config.

The rule: the contract imports nothing of the transport (tests/events/test_layering.py
checks that importing it loads no ZeroMQ); the transport imports the contract; routers
and replicas import both. Importing this package has no side effect.
"""

from .blockset import BlockSet, StoredBlock, snapshot_events
from .hashing import ALGOS, DEFAULT_SEED, BlockHasher, HashConfig, regime_salt, to_external
from .wire import (
    LOWER_MEDIA,
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BatchEncoder,
    BlockRemoved,
    BlockStored,
    EventBatch,
    ExternalBlockHash,
    KVCacheEvent,
    MalformedBatchError,
    decode_batch,
    encode_batch,
    tier_name,
)

__all__ = [
    "ALGOS",
    "DEFAULT_SEED",
    "LOWER_MEDIA",
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "AllBlocksCleared",
    "BatchEncoder",
    "BlockHasher",
    "BlockRemoved",
    "BlockSet",
    "BlockStored",
    "EventBatch",
    "ExternalBlockHash",
    "HashConfig",
    "KVCacheEvent",
    "MalformedBatchError",
    "StoredBlock",
    "decode_batch",
    "encode_batch",
    "regime_salt",
    "snapshot_events",
    "tier_name",
    "to_external",
]
