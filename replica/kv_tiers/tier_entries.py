"""The records of the KV tiers: a block's metadata, a host copy, a load in progress.

Split out of :mod:`.tiers` so the engine's scheduler, the disk fetcher and the remote
fetcher can name what they hand each other (:class:`LoadJob`) apart from the tiers
themselves: :class:`BlockMeta` (what a block's ``BlockStored`` says beside its hash),
:class:`HostEntry` (one block's bytes in host memory, and its checksum once sealed) and
:class:`LoadJob` (blocks to bring back for one request, filled in by the loader).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .disk import checksum

if TYPE_CHECKING:
    from kvroute.events.kv_transfer import KVSource

__all__ = ["BlockMeta", "HostEntry", "LoadJob"]


@dataclass(slots=True, frozen=True)
class BlockMeta:
    """What a block's ``BlockStored`` says beside its hash."""

    parent: bytes | None
    token_ids: tuple[int, ...]
    lora_name: str | None


@dataclass(slots=True)
class HostEntry:
    data: torch.Tensor  # uint8, the block's K and V of every layer, on the host
    meta: BlockMeta
    ready: torch.cuda.Event | None = None  # CUDA: recorded after the copy-out was enqueued
    digest: int | None = None  # xxh3-64 of data, once sealed

    def seal(self) -> int:
        """Its checksum, computed once its bytes are there (any thread; computing it twice
        gives the same value)."""
        if self.digest is None:
            if self.ready is not None:
                self.ready.synchronize()
            self.digest = checksum(self.data.numpy())
        return self.digest


@dataclass
class LoadJob:
    """Blocks to bring back for one request, in chain order; filled in by the loader."""

    request_id: str
    block_ids: list[int]
    media: list[str]
    hashes: list[bytes]
    host_entries: list[HostEntry | None]
    after: torch.cuda.Event | None = None  # CUDA: the step's stream when the load started
    fetched: list[bytearray | memoryview | None] = field(default_factory=list)  # disk/remote, read
    start: int = 0  # the chain position of hashes[0] (of block_ids[0])
    source: KVSource | None = None  # where its REMOTE blocks (a suffix) are pulled from
    num_ok: int = 0  # leading blocks copied and verified
    failed: bytes | None = None  # the hash that stopped the load, if one did
    seconds: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)
