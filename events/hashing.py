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
seed as a CBOR text string. vLLM derives its seed from ``PYTHONHASHSEED`` when set, else
(for sha256 and sha256_cbor) the fixed ``"vllm-none-hash"``, kvroute's default.

``sha256_cbor_tagged`` -- vLLM 0.32's ``sha256_cbor``: the same CBOR and SHA-256, but each
extra key tagged by its source: ``extra`` is ``[["lora", name, path]?, ["cache_salt",
salt]?]`` (LoRA on every block, the salt on block 0 only). Unsalted prompts hash as in
``sha256_cbor``. A router indexing vLLM 0.32 engines whose requests carry a ``cache_salt``
(every kvroute tenant's do) needs this one; its LoRA keys also need the adapter's path.

External (event) form: raw digest bytes, or vLLM's integer form -- the low 64 bits of the
digest, i.e. its last 8 bytes read big-endian as an unsigned integer.

Speed: the ``xxh3_128`` chain loop runs in an optional C extension, ``kvroute.events._chain``
(built by ``pip install`` when a C compiler exists), which calls the very ``XXH3_128bits`` of
the installed ``xxhash`` wheel; same bytes, without a Python call per block (long prompts hash
many times faster: ``benchmarks/bench_hashing.py``, BENCHMARKS.md). Without it, or with
``KVROUTE_PURE_PYTHON_HASH=1`` in the environment, the pure-Python loop below runs.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import operator
import os
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import cbor2
import xxhash

from .wire import ExternalBlockHash  # defined once, with the wire's bounds

log = logging.getLogger(__name__)

HashAlgo = Literal["xxh3_128", "sha256_cbor", "sha256_cbor_tagged"]
HashForm = Literal["bytes", "int"]

ALGOS: tuple[str, ...] = ("xxh3_128", "sha256_cbor", "sha256_cbor_tagged")
DEFAULT_SEED = "vllm-none-hash"
DEFAULT_BLOCK_SIZE = 16

_TAG_LORA = b"\x01"
_TAG_SALT = b"\x02"
_U64 = (1 << 64) - 1
_U32 = (1 << 32) - 1

PURE_PYTHON_ENV = "KVROUTE_PURE_PYTHON_HASH"
"""Set to 1 to force the pure-Python xxh3_128 path (tests, benchmarks, debugging)."""


LONG_PROMPT_SALT = "rope-long"


def regime_salt(
    cache_salt: str | None, num_prompt_tokens: int, long_after: int | None
) -> str | None:
    """The salt a prompt's blocks are hashed with on a replica whose rotary embedding
    switches to other frequencies past ``long_after`` tokens (longrope: Phi-3's 128k
    models; the replica reports it in ``ReplicaInfo.long_prompt_after``, None where there
    is no switch): a longer prompt's keys are of the other regime, so its blocks must never
    meet a shorter prompt's; its salt gets ``LONG_PROMPT_SALT`` (after a 0x1f separator).
    Replica and router both apply it, so their hashes agree."""
    if long_after is None or num_prompt_tokens <= long_after:
        return cache_salt
    return f"{cache_salt}\x1f{LONG_PROMPT_SALT}" if cache_salt else LONG_PROMPT_SALT


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
        *,
        accelerate: bool | None = None,
        memo: int = 0,
    ) -> None:
        """``accelerate``: None uses the C chain loop for xxh3_128 when it is built and
        ``KVROUTE_PURE_PYTHON_HASH`` is not set; True requires it (ImportError if missing);
        False never uses it. The hashes are the same bytes either way. ``memo``: how many
        ``sha256_cbor`` block hashes to keep by what they hash (0: none), for a router that
        hashes the same shared prefixes request after request (a block costs ~8 us of CBOR
        and SHA-256, a lookup ~1 us); the oldest kept goes first."""
        if algo not in ALGOS:
            raise ValueError(f"unknown hash algorithm {algo!r}; choose one of {ALGOS}")
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if not isinstance(seed, str):
            raise TypeError(f"seed must be a str, got {type(seed).__name__}")
        self.memo = memo
        self._memo: dict[tuple[Any, ...], bytes] = {}
        self.config = HashConfig(algo, seed, block_size)
        self.algo = algo
        self.seed = seed
        self.block_size = block_size
        if algo == "xxh3_128":
            self.none_hash = xxhash.xxh3_128_digest(b"kvroute:" + seed.encode())
        else:
            self.none_hash = hashlib.sha256(cbor2.dumps(seed, canonical=True)).digest()
        use = accelerate if accelerate is not None else not _env_forces_pure()
        self._chain = _accelerator() if use and algo == "xxh3_128" else None
        if accelerate is True and algo == "xxh3_128" and self._chain is None:
            raise ImportError(
                "kvroute.events._chain is not built or failed its self-check; reinstall "
                "kvroute with a C compiler, or pass accelerate=None/False"
            )

    @property
    def accelerated(self) -> bool:
        """Whether hash_blocks runs the compiled chain loop."""
        return self._chain is not None

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
        lora_path: str | None = None,
    ) -> list[bytes]:
        """Hashes of the full blocks of ``token_ids`` (a trailing partial block is ignored).

        ``parent`` and ``start_block`` continue a chain: ``token_ids`` then holds the tokens
        from block ``start_block`` on, and ``parent`` is the hash of block ``start_block-1``.
        The salt only enters block 0, so it is ignored when ``start_block > 0``.
        ``lora_path``: the adapter's path, which ``sha256_cbor_tagged`` hashes beside its
        name (required there with ``lora_name``; the other algorithms ignore it).
        """
        if (parent is None) != (start_block == 0):
            raise ValueError("parent must be given exactly when start_block > 0")
        if self.algo == "xxh3_128":
            return self._hash_xxh3(token_ids, cache_salt, lora_name, parent, start_block)
        if self.algo == "sha256_cbor_tagged":
            lora: list[str] | None = None
            if lora_name:
                if lora_path is None:
                    raise ValueError("sha256_cbor_tagged hashes a LoRA's path: pass lora_path")
                lora = ["lora", lora_name, lora_path]
            salt = ["cache_salt", cache_salt] if cache_salt else None
            return self._hash_sha256_cbor(token_ids, salt, lora, parent, start_block)
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
        n = n_blocks * bs
        header = bs.to_bytes(4, "little")
        lora = _extra(_TAG_LORA, lora_name)
        salt = _extra(_TAG_SALT, cache_salt) if start_block == 0 else b""
        h = self.none_hash if parent is None else parent
        if len(h) != 16:
            raise ValueError(f"parent must be a 16-byte xxh3_128 digest, got {len(h)} bytes")
        chain = self._chain
        if chain is not None:
            # Same layout as below: block 0's tail is lora + salt, later blocks' is lora.
            if isinstance(token_ids, (list, tuple)):
                fast = chain.xxh3_chain(token_ids, n, bs, h, header, lora + salt, lora)
                if fast is not None:
                    return fast
            # Not a plain list of ints in range: convert (and raise) exactly as the pure path.
            buf = _u32_bytes(token_ids, n)
            result = chain.xxh3_chain(buf, n, bs, h, header, lora + salt, lora)
            if result is None:  # pragma: no cover - the C code declines only list/tuple input
                raise RuntimeError("kvroute.events._chain declined a uint32 buffer")
            return result
        buf = _u32_bytes(token_ids, n)
        step = 4 * bs
        digest = xxhash.xxh3_128_digest
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
        cache_salt: str | list[str] | None,
        lora_name: str | list[str] | None,
        parent: bytes | None,
        start_block: int,
    ) -> list[bytes]:
        """The extra keys as they enter the CBOR: bare strings (``sha256_cbor``) or
        ``[source, value...]`` arrays (``sha256_cbor_tagged``)."""
        bs = self.block_size
        n_blocks = len(token_ids) // bs
        tokens = list(map(int, token_ids[: n_blocks * bs]))
        h = self.none_hash if parent is None else parent
        out: list[bytes] = []
        memo, keep = self._memo, self.memo
        # What the memo knows a block's extras by: the same strings and arrays, hashable.
        lora_key = (_hashable(lora_name),) if keep and lora_name else ()
        salt_key = (_hashable(cache_salt),) if keep and cache_salt else ()
        for i in range(n_blocks):
            block = tokens[i * bs : (i + 1) * bs]
            salted = start_block + i == 0
            if keep:
                key = (h, tuple(block)) + (lora_key + salt_key if salted else lora_key)
                got = memo.get(key)
                if got is not None:
                    h = got
                    out.append(h)
                    continue
            extra: list[str | list[str]] = []
            if lora_name:
                extra.append(lora_name)
            if cache_salt and salted:
                extra.append(cache_salt)
            h = hashlib.sha256(cbor2.dumps([h, block, extra or None], canonical=True)).digest()
            out.append(h)
            if keep:
                memo[key] = h
                if len(memo) > keep:
                    del memo[next(iter(memo))]
        return out


def _hashable(extra: str | list[str]) -> str | tuple[str, ...]:
    return extra if isinstance(extra, str) else tuple(extra)


def _extra(tag: bytes, value: str | None) -> bytes:
    if not value:
        return b""
    raw = value.encode()
    return tag + len(raw).to_bytes(4, "little") + raw


def _u32_bytes(token_ids: Sequence[int], n: int) -> bytes:
    """The first ``n`` tokens as little-endian uint32 bytes (fast path for lists).

    Anything with ``__index__`` (numpy and torch integers) counts as an int; floats and
    strings do not, so a float token is an error rather than silently truncated.
    """
    if isinstance(token_ids, (bytes, bytearray, memoryview, str)):
        raise TypeError(f"token_ids must be a sequence of ints, not {type(token_ids).__name__}")
    head = token_ids[:n] if len(token_ids) != n else token_ids
    try:
        arr = array("I", head)
    except (OverflowError, TypeError):
        # numpy/torch integer arrays and other int-likes, or a bad token: name it
        arr = array("I", [_token(t, i) for i, t in enumerate(head)])
    if arr.itemsize != 4:  # pragma: no cover - exotic platforms
        raise RuntimeError("array('I') is not 32-bit on this platform")
    if _BIG_ENDIAN:  # pragma: no cover
        arr.byteswap()
    return arr.tobytes()


def _env_forces_pure() -> bool:
    """Whether KVROUTE_PURE_PYTHON_HASH asks for the pure-Python path (any value but 0)."""
    return os.environ.get(PURE_PYTHON_ENV, "") not in ("", "0")


def _token(t: object, i: int) -> int:
    """One token as an int in uint32 range, or a clear error naming it and its index."""
    try:
        v = operator.index(t)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"token ids must be ints; token {i} is {type(t).__name__} {t!r}") from None
    if not 0 <= v <= _U32:
        raise OverflowError(f"token ids must fit in uint32 [0, 2**32-1]; token {i} is {v}")
    return v


_BIG_ENDIAN = array("I", [1]).tobytes()[0] == 0


class _ChainModule(Protocol):
    """The interface of the compiled ``kvroute.events._chain`` (see events/_chain.c)."""

    def bind(self, path: str) -> None: ...

    def xxh3_chain(
        self,
        tokens: object,
        n_tokens: int,
        block_size: int,
        parent: bytes,
        header: bytes,
        tail0: bytes,
        tail: bytes,
    ) -> list[bytes] | None: ...


@functools.cache
def _accelerator() -> _ChainModule | None:
    """The compiled chain loop bound to xxhash's own XXH3_128bits, or None.

    The symbol is resolved by name at run time, so it is trusted only after it reproduces
    the pure-Python chain on a small input with both tails set.
    """
    try:
        from . import _chain  # type: ignore[attr-defined]  # compiled; may be absent
    except ImportError:
        return None
    candidates = [getattr(getattr(xxhash, "_xxhash", None), "__file__", None), "libxxhash.so.0"]
    for path in candidates:
        if not path:
            continue
        try:
            _chain.bind(path)
        except OSError as e:
            log.debug("kvroute.events._chain: %s", e)
            continue
        if _self_check(_chain):
            return _chain
        log.warning("kvroute.events._chain: XXH3_128bits from %s disagrees with xxhash", path)
    return None


def _self_check(chain: _ChainModule) -> bool:
    """Whether the C chain gives the pure path's bytes on 4 blocks with salt and LoRA."""
    tokens = [0, 1, 2**32 - 1, 151_935, 7, 65_536, 3, 2**31]
    parent = xxhash.xxh3_128_digest(b"kvroute:self-check")
    header = (2).to_bytes(4, "little")
    tail, tail0 = _extra(_TAG_LORA, "l"), _extra(_TAG_LORA, "l") + _extra(_TAG_SALT, "s")
    buf = _u32_bytes(tokens, len(tokens))
    want, h = [], parent
    for i in range(4):
        h = xxhash.xxh3_128_digest(
            h + header + buf[8 * i : 8 * i + 8] + (tail0 if i == 0 else tail)
        )
        want.append(h)
    try:
        return chain.xxh3_chain(tokens, 8, 2, parent, header, tail0, tail) == want
    except Exception:  # a bad symbol must never break hashing
        log.exception("kvroute.events._chain self-check failed")
        return False
