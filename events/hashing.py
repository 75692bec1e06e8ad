"""Chained block hashes: the one name a replica and a router both give a prefix.

A block is ``block_size`` consecutive tokens; only full blocks are hashed. The hash of
block ``i`` folds in the hash of block ``i - 1``, so one hash names the whole prefix::

    h_0 = H(NONE_HASH, tokens[0:B],   extra_0)
    h_i = H(h_{i-1},   tokens[iB:(i+1)B], extra_i)
    NONE_HASH = H(seed)

``extra_i`` holds the LoRA adapter name (every block) and the cache salt (block 0 only;
the chain carries it to every later block). Two algorithms:

``xxh3_128`` (default) -- the digest is XXH3-128 (16 bytes) of this canonical layout::

    parent digest            16 bytes (NONE_HASH for block 0)
    token count n            uint32, little-endian
    tokens                   n x uint32, little-endian
    for each extra key, in the order lora then cache_salt:
        tag                  1 byte: 0x01 = lora, 0x02 = cache_salt
        length               uint32, little-endian
        value                UTF-8 bytes
    NONE_HASH = XXH3-128(b"kvroute:" + UTF-8 seed)

``sha256_cbor`` -- byte-identical to vLLM's ``sha256_cbor`` prefix-caching scheme, so a
kvroute router can index a fleet of vLLM engines:
``H(x) = SHA-256(canonical CBOR of x)``, ``x = [parent (32-byte string), [token ints],
extra or null]``, where ``extra`` is the array ``[lora_name?, cache_salt?]`` (vLLM puts the
LoRA name first and the salt, in block 0 only, after it) and ``NONE_HASH = H(seed)`` with the
seed as a CBOR text string. vLLM derives its seed from ``PYTHONHASHSEED`` (random when
unset): start every vLLM engine with ``PYTHONHASHSEED=<seed>`` and give kvroute the same
``<seed>``.

External (event) form: raw digest bytes, or vLLM's integer form -- the low 64 bits of the
digest, i.e. its last 8 bytes read big-endian as an unsigned integer.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import cbor2
import xxhash

HashAlgo = Literal["xxh3_128", "sha256_cbor"]
HashForm = Literal["bytes", "int"]
ExternalBlockHash = bytes | int

ALGOS: tuple[str, ...] = ("xxh3_128", "sha256_cbor")
DEFAULT_SEED = "vllm-none-hash"
DEFAULT_BLOCK_SIZE = 16

_TAG_LORA = b"\x01"
_TAG_SALT = b"\x02"
_U64 = (1 << 64) - 1


def to_external(block_hash: bytes, form: HashForm = "bytes") -> ExternalBlockHash:
    """The form a hash travels in inside events."""
    if form == "bytes":
        return block_hash
    if form == "int":
        return int.from_bytes(block_hash[-8:], "big") & _U64
    raise ValueError(f"unknown hash form {form!r}; expected 'bytes' or 'int'")


@dataclass(frozen=True, slots=True)
class HashConfig:
    """What every replica and router of one fleet must agree on."""

    algo: str = "xxh3_128"
    seed: str = DEFAULT_SEED
    block_size: int = DEFAULT_BLOCK_SIZE

    def mismatch(self, other: HashConfig) -> str | None:
        """A human-readable reason two configs disagree, or None when they agree."""
        diffs = [
            f"{name}: {getattr(self, name)!r} != {getattr(other, name)!r}"
            for name in ("algo", "seed", "block_size")
            if getattr(self, name) != getattr(other, name)
        ]
        return "; ".join(diffs) or None


class BlockHasher:
    """Computes chained block hashes for one (algorithm, seed, block size)."""

    def __init__(
        self,
        algo: str = "xxh3_128",
        seed: str = DEFAULT_SEED,
        block_size: int = DEFAULT_BLOCK_SIZE,
    ) -> None:
        if algo not in ALGOS:
            raise ValueError(f"unknown hash algorithm {algo!r}; choose one of {ALGOS}")
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if not isinstance(seed, str):
            raise TypeError(f"seed must be a str, got {type(seed).__name__}")
        self.config = HashConfig(algo, seed, block_size)
        self.algo = algo
        self.seed = seed
        self.block_size = block_size
        if algo == "xxh3_128":
            self.none_hash = xxhash.xxh3_128_digest(b"kvroute:" + seed.encode())
        else:
            self.none_hash = hashlib.sha256(cbor2.dumps(seed, canonical=True)).digest()

    def __repr__(self) -> str:
        return f"BlockHasher(algo={self.algo!r}, seed={self.seed!r}, block_size={self.block_size})"

    def hash_blocks(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        parent: bytes | None = None,
        start_block: int = 0,
    ) -> list[bytes]:
        """Hashes of the full blocks of ``token_ids`` (a trailing partial block is ignored).

        ``parent`` and ``start_block`` continue a chain: ``token_ids`` then holds the tokens
        from block ``start_block`` on, and ``parent`` is the hash of block ``start_block-1``.
        The salt only enters block 0, so it is ignored when ``start_block > 0``.
        """
        if (parent is None) != (start_block == 0):
            raise ValueError("parent must be given exactly when start_block > 0")
        if self.algo == "xxh3_128":
            return self._hash_xxh3(token_ids, cache_salt, lora_name, parent, start_block)
        return self._hash_sha256_cbor(token_ids, cache_salt, lora_name, parent, start_block)

    # -- xxh3_128 ----------------------------------------------------------------------
    def _hash_xxh3(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None,
        lora_name: str | None,
        parent: bytes | None,
        start_block: int,
    ) -> list[bytes]:
        bs = self.block_size
        n_blocks = len(token_ids) // bs
        if n_blocks == 0:
            return []
        buf = _u32_bytes(token_ids, n_blocks * bs)
        step = 4 * bs
        header = bs.to_bytes(4, "little")
        lora = _extra(_TAG_LORA, lora_name)
        salt = _extra(_TAG_SALT, cache_salt) if start_block == 0 else b""
        digest = xxhash.xxh3_128_digest
        h = self.none_hash if parent is None else parent
        out: list[bytes] = []
        append = out.append
        # Block 0 may carry the salt; later blocks only the LoRA name.
        h = digest(h + header + buf[0:step] + lora + salt)
        append(h)
        tail = lora
        if tail:
            for off in range(step, n_blocks * step, step):
                h = digest(h + header + buf[off : off + step] + tail)
                append(h)
        else:
            for off in range(step, n_blocks * step, step):
                h = digest(h + header + buf[off : off + step])
                append(h)
        return out

    # -- sha256_cbor (vLLM-compatible) --------------------------------------------------
    def _hash_sha256_cbor(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None,
        lora_name: str | None,
        parent: bytes | None,
        start_block: int,
    ) -> list[bytes]:
        bs = self.block_size
        n_blocks = len(token_ids) // bs
        tokens = [int(t) for t in token_ids[: n_blocks * bs]]
        h = self.none_hash if parent is None else parent
        out: list[bytes] = []
        for i in range(n_blocks):
            extra: list[str] = []
            if lora_name:
                extra.append(lora_name)
            if cache_salt and start_block + i == 0:
                extra.append(cache_salt)
            item = [h, tokens[i * bs : (i + 1) * bs], extra or None]
            h = hashlib.sha256(cbor2.dumps(item, canonical=True)).digest()
            out.append(h)
        return out


def _extra(tag: bytes, value: str | None) -> bytes:
    if not value:
        return b""
    raw = value.encode()
    return tag + len(raw).to_bytes(4, "little") + raw


def _u32_bytes(token_ids: Sequence[int], n: int) -> bytes:
    """The first ``n`` tokens as little-endian uint32 bytes (fast path for lists)."""
    if isinstance(token_ids, (bytes, bytearray, memoryview)):
        raise TypeError("token_ids must be a sequence of ints, not bytes")
    try:
        arr = array("I", token_ids[:n] if len(token_ids) != n else token_ids)
    except (OverflowError, TypeError):
        # numpy/torch integer arrays and other int-likes
        arr = array("I", (int(t) for t in token_ids[:n]))
    if arr.itemsize != 4:  # pragma: no cover - exotic platforms
        raise RuntimeError("array('I') is not 32-bit on this platform")
    if _BIG_ENDIAN:  # pragma: no cover
        arr.byteswap()
    return arr.tobytes()


_BIG_ENDIAN = array("I", [1]).tobytes()[0] == 0
