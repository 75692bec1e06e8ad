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
- ``entries`` (hash -> payload bytes) names exactly the blocks this store counts: each has
  its file, or (under :class:`.kv_disk_writer.DiskWriter`) a write queued or under way that
  will make it; their sizes sum to ``used_bytes <= capacity_bytes``, pending writes counted;
- the LRU order is ``entries``' order: the first is evicted next;
- a write replaces a file atomically (temporary name, then ``os.replace``), so a reader
  never sees half a file of its own making; another process's damage is caught by the
  checksum.

Thread-safety: the bookkeeping (:meth:`reserve`, :meth:`forget`, :meth:`touch`, and
:meth:`put`, :meth:`discard`, :meth:`clear` which use it) is one thread's, the engine's.
:meth:`write_file`, :meth:`remove_file` and :meth:`read` touch only the file system and run
on any thread (the writer, the loader): a file removed under a reader reads as a miss.
"""

from __future__ import annotations

import contextlib
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
        """Writes a block now (most recently used); returns the hashes evicted to make room,
        or None when it could not be written (full disk, bad folder: the block is just
        lost). The engine goes through :class:`.kv_disk_writer.DiskWriter` instead, which
        does the same in two halves: :meth:`reserve` on its thread, :meth:`write_file` on a
        writer thread."""
        fresh = block_hash not in self.entries
        evicted = self.reserve(block_hash, len(data))
        if evicted is None:
            return None
        for old in evicted:
            self.remove_file(old)
        if fresh and not self.write_file(block_hash, data, digest):
            self.write_errors += 1
            self.forget(block_hash)
            return evicted if evicted else None
        return evicted

    def reserve(self, block_hash: bytes, size: int) -> list[bytes] | None:
        """Counts a block of ``size`` bytes in (most recently used) before its file exists,
        evicting from the LRU end to make room; returns the evicted hashes, whose files the
        caller removes, or None when it is larger than the whole store. Bookkeeping only."""
        if size > self.capacity_bytes:
            return None
        if block_hash in self.entries:
            self.entries.move_to_end(block_hash)
            return []
        evicted: list[bytes] = []
        while self.used_bytes + size > self.capacity_bytes:
            h, _ = next(iter(self.entries.items()))
            self.forget(h)
            evicted.append(h)
        self.entries[block_hash] = size
        self.used_bytes += size
        return evicted

    def forget(self, block_hash: bytes) -> bool:
        """Drops a block from the bookkeeping (not its file); False when it was not here."""
        size = self.entries.pop(block_hash, None)
        if size is None:
            return False
        self.used_bytes -= size
        return True

    def write_file(self, block_hash: bytes, data: bytes | memoryview, digest: int) -> bool:
        """Writes the block's file atomically (temporary name, then ``os.replace``); False
        on any OSError, leaving no file. Touches only the file system (any thread)."""
        target = self.file_of(block_hash)
        tmp = target.with_name(target.name + ".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(_HEADER.pack(MAGIC, len(data), digest))
                f.write(data)
            os.replace(tmp, target)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            return False
        return True

    def remove_file(self, block_hash: bytes) -> None:
        """Removes the block's file if there is one (any thread)."""
        with contextlib.suppress(OSError):
            self.file_of(block_hash).unlink()

    def touch(self, block_hash: bytes) -> None:
        if block_hash in self.entries:
            self.entries.move_to_end(block_hash)

    def discard(self, block_hash: bytes) -> bool:
        """Forgets a block and removes its file; False when it was not here."""
        if not self.forget(block_hash):
            return False
        self.remove_file(block_hash)
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
