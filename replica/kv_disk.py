"""The KV cache's disk tier: one file per block under a local folder, in LRU order.

A block evicted past the host tier (or straight from the device, with no host tier) is
written here as ``<hash hex>.kvb``: a fixed header (magic, payload length, xxh3-64 of the
payload) then the block's bytes. A read checks all three; anything off -- a missing file, a
short one, a flipped bit -- reads as ``None``, and the caller recomputes the block.

Why wipe at start: a restarted replica's router has dropped its entries (its publisher is
new), and files written by an earlier process carry no trustworthy event history (their
parents, tokens and adapter are what the events need). Re-adopting them would mean
publishing blocks whose provenance this process cannot vouch for, so the store removes its
own ``*.kvb`` files when it opens and starts empty: a restart never leaves a stale entry.

Invariants:
- ``entries`` (hash -> payload bytes) names exactly the files this store wrote and still
  keeps; their sizes sum to ``used_bytes <= capacity_bytes``;
- the LRU order is ``entries``' order: the first is evicted next;
- a write replaces a file atomically (temporary name, then ``os.replace``), so a reader
  never sees half a file of its own making; another process's damage is caught by the
  checksum.

Thread-safety: :meth:`read` may run on a loader thread while the engine's thread puts or
drops entries; it touches only the file system (a file removed under it reads as a miss).
"""

from __future__ import annotations

import os
import struct
from collections import OrderedDict
from pathlib import Path

import xxhash

MAGIC = b"KVB1"
_HEADER = struct.Struct("<4sQQ")  # magic, payload length, xxh3_64 of the payload
SUFFIX = ".kvb"


def checksum(data: bytes | memoryview) -> int:
    """xxh3-64 of a block's bytes: fast enough to run on every store and load."""
    return xxhash.xxh3_64_intdigest(data)


class DiskStore:
    """Blocks as files under ``path``, at most ``capacity_bytes`` of payload, LRU."""

    def __init__(self, path: str | os.PathLike[str], capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"kv_disk_bytes must be positive, got {capacity_bytes}")
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.entries: OrderedDict[bytes, int] = OrderedDict()
        self.used_bytes = 0
        self.num_wiped = self._wipe()
        self.write_errors = 0

    def _wipe(self) -> int:
        """Removes this store's files left by an earlier process (see the module doc)."""
        n = 0
        for f in self.path.glob(f"*{SUFFIX}*"):
            try:
                f.unlink()
                n += 1
            except OSError:
                pass
        return n

    def file_of(self, block_hash: bytes) -> Path:
        return self.path / f"{block_hash.hex()}{SUFFIX}"

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def put(self, block_hash: bytes, data: bytes | memoryview, digest: int) -> list[bytes] | None:
        """Writes a block (most recently used); returns the hashes evicted to make room, or
        None when it could not be written (full disk, bad folder: the block is just lost)."""
        size = len(data)
        if size > self.capacity_bytes:
            return None
        if block_hash in self.entries:
            self.entries.move_to_end(block_hash)
            return []
        evicted: list[bytes] = []
        while self.used_bytes + size > self.capacity_bytes:
            evicted.append(self._drop_lru())
        target = self.file_of(block_hash)
        tmp = target.with_name(target.name + ".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(_HEADER.pack(MAGIC, size, digest))
                f.write(data)
            os.replace(tmp, target)
        except OSError:
            self.write_errors += 1
            tmp.unlink(missing_ok=True)
            return evicted if evicted else None
        self.entries[block_hash] = size
        self.used_bytes += size
        return evicted

    def _drop_lru(self) -> bytes:
        h, _ = next(iter(self.entries.items()))
        self.discard(h)
        return h

    def touch(self, block_hash: bytes) -> None:
        if block_hash in self.entries:
            self.entries.move_to_end(block_hash)

    def discard(self, block_hash: bytes) -> bool:
        """Forgets a block and removes its file; False when it was not here."""
        size = self.entries.pop(block_hash, None)
        if size is None:
            return False
        self.used_bytes -= size
        try:
            self.file_of(block_hash).unlink()
        except OSError:
            pass
        return True

    def read(self, block_hash: bytes, expected_size: int) -> bytes | None:
        """The block's verified bytes, or None if its file is missing, short, foreign or
        corrupt (any thread)."""
        try:
            raw = self.file_of(block_hash).read_bytes()
        except OSError:
            return None
        if len(raw) < _HEADER.size:
            return None
        magic, size, digest = _HEADER.unpack_from(raw)
        payload = memoryview(raw)[_HEADER.size :]
        if magic != MAGIC or size != expected_size or len(payload) != size:
            return None
        if checksum(payload) != digest:
            return None
        return raw[_HEADER.size :]

    def clear(self) -> None:
        for h in list(self.entries):
            self.discard(h)

    def check_invariants(self) -> None:
        if self.used_bytes != sum(self.entries.values()):
            raise AssertionError("used_bytes does not add up")
        if self.used_bytes > self.capacity_bytes:
            raise AssertionError("over capacity")
