"""The disk tier's encryption at rest: AES-256-GCM under a key that lives only in memory.

Why: a KV block is the tenant's prompt in another form. Layer 0's V of a token depends on
the token alone, so anyone holding the public weights reads a plaintext block straight back
into its tokens (issue 50's review did it with 30 lines). File modes keep other local users
out (:mod:`.kv_disk`); encryption also covers what modes do not: a copied disk image, a
backup, a folder left behind by a killed process, root reading the disk offline.

Why a per-process random key, held only here: disk blocks are never re-adopted after a
restart (the store wipes its folder at start, see :mod:`.kv_disk`), so no key ever needs to
outlive the process; one that never touches the disk cannot leak from it. The key dies
with the process, and with it every file written under it.

Invariants:
- the key is drawn from the OS (``AESGCM.generate_key``) when a :class:`Sealer` is made
  and is never written anywhere, logged or returned;
- no two seals under one key share a nonce: a nonce is a random per-sealer prefix
  (4 bytes) and a counter (8 bytes) taken under a lock;
- the associated data binds a ciphertext to its block hash and plaintext length: a file
  renamed to another block's name, or cut and padded to another size, fails to open.

Cost (issue 50): AES-GCM runs at ~9 GB/s here (~220 us for an 8B model's 2 MiB block) and
``cryptography`` holds the GIL while it runs; a file read releases it. So the disk fetcher
opens a block while the next one's read is under way on a reader thread (:mod:`.disk_reads`),
straight into the buffer the loader copies from (:meth:`Sealer.open_into`). That hides the
open behind reads that wait on the disk, and behind reads from the page cache only where a
core is free for them: the CPU it costs is moved, not removed (BENCHMARKS, issue 50).

Thread-safety: :meth:`Sealer.seal`, :meth:`Sealer.seal_into`, :meth:`Sealer.open` and
:meth:`Sealer.open_into` run on any thread (the disk writer seals, the disk fetchers and
readers open); ``AESGCM`` holds no per-call state.
"""

from __future__ import annotations

import os
import struct
import threading
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

NONCE_BYTES = 12
TAG_BYTES = 16
_AAD = struct.Struct("<8sQ")  # a domain tag, then the plaintext length; the hash follows
_DOMAIN = b"kvroute1"


class Sealer:
    """Seals and opens one process's disk blocks (AES-256-GCM, key in memory only)."""

    def __init__(self) -> None:
        self._aead = AESGCM(AESGCM.generate_key(bit_length=256))
        self._prefix = os.urandom(4)
        self._count = 0
        self._lock = threading.Lock()

    def _nonce(self) -> bytes:
        with self._lock:
            self._count += 1
            n = self._count
        return self._prefix + n.to_bytes(8, "big")

    @staticmethod
    def _aad(block_hash: bytes, size: int) -> bytes:
        return _AAD.pack(_DOMAIN, size) + block_hash

    def seal(self, block_hash: bytes, data: bytes | memoryview) -> tuple[bytes, bytes]:
        """(nonce, ciphertext with its 16-byte tag) of a block's bytes."""
        nonce = self._nonce()
        return nonce, self._aead.encrypt(nonce, data, self._aad(block_hash, len(data)))

    def seal_into(self, block_hash: bytes, data: bytes | memoryview, out: memoryview) -> bytes:
        """Seals into ``out`` (``len(data) + TAG_BYTES`` bytes: a buffer the writer reuses,
        sparing a fresh allocation per block); returns the nonce."""
        nonce = self._nonce()
        self._aead.encrypt_into(nonce, data, self._aad(block_hash, len(data)), out)
        return nonce

    def open(
        self, block_hash: bytes, nonce: bytes, sealed: bytes | memoryview, size: int
    ) -> bytearray | None:
        """The block's bytes (in a buffer of their own, the caller's to keep), or None when
        they fail authentication: another key (another process), another block's file, a
        wrong length, a flipped bit."""
        out = bytearray(size)
        return out if self.open_into(block_hash, nonce, sealed, out) else None

    def open_into(
        self, block_hash: bytes, nonce: bytes, sealed: bytes | memoryview, out: Any
    ) -> bool:
        """Opens into ``out`` (a writable buffer of exactly the block's size: the one the
        loader copies from, sparing a copy); False when the bytes fail authentication (as
        :meth:`open`). On False ``out`` may hold unauthenticated bytes: the caller drops it,
        never hands it on."""
        size = memoryview(out).nbytes
        if len(sealed) != size + TAG_BYTES or len(nonce) != NONCE_BYTES:
            return False
        try:
            self._aead.decrypt_into(nonce, sealed, self._aad(block_hash, size), out)
        except InvalidTag:
            return False
        return True
