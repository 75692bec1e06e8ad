"""The contract between replicas and routers: block hashing, KV events, and their transport.

Everything a router needs to know about a replica's cache crosses this package: the chained
block hashes both sides compute (:mod:`.hashing`), the events in vLLM's wire format
(:mod:`.wire`), and the ZeroMQ publisher and subscriber that carry them without silent loss
(:mod:`.publisher`, :mod:`.subscriber`).
"""

from .blockset import BlockSet, StoredBlock, snapshot_events
from .hashing import ALGOS, DEFAULT_SEED, BlockHasher, HashConfig, to_external
from .publisher import ZmqEventPublisher
from .subscriber import ReplicaBatch, ReplicaStats, ZmqEventSubscriber
from .torch_wheels import hide_broken as _hide_broken
from .wire import (
    MEDIUM_CPU,
    MEDIUM_GPU,
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
)

# Before any caller reads a model's config: torchvision & co. that cannot load look absent.
_hide_broken()

__all__ = [
    "ALGOS",
    "DEFAULT_SEED",
    "MEDIUM_CPU",
    "MEDIUM_GPU",
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
    "ReplicaBatch",
    "ReplicaStats",
    "StoredBlock",
    "ZmqEventPublisher",
    "ZmqEventSubscriber",
    "decode_batch",
    "encode_batch",
    "snapshot_events",
    "to_external",
]
