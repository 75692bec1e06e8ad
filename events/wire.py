"""KV-cache events in vLLM's wire format, and a decoder that reads every form of it.

One ZeroMQ message carries one ``EventBatch``. kvroute encodes::

    EventBatch = [ts: float, events: list, data_parallel_rank: int | nil]      (msgpack array)
    event      = {"type": "BlockStored" | "BlockRemoved" | "AllBlocksCleared", ...fields}

Event fields follow vLLM's ``vllm.distributed.kv_events``: the fields vLLM declares without
a default are always written (``nil`` included) so vLLM's own typed decoders accept them;
fields with a default are omitted when at their default.

vLLM itself has shipped three layouts over time -- events as tagged arrays
(``["BlockStored", hashes, parent, ...]``) inside an array batch, events as maps inside an
array batch, and (newest main) events as maps inside a map batch
(``{"ts":..., "events":..., "data_parallel_rank":...}``). :func:`decode_batch` reads all of
them; :class:`BatchEncoder` writes the array batch (docs/architecture.md) or, on request,
the map batch.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

MAX_HASH_BYTES = 64  # a digest longer than this is not a block hash
# A block hash as events carry it: a raw digest, or vLLM's uint64 form. Checked by msgspec in
# C while decoding; kvroute.events.hashing.to_external produces either form.
ExternalBlockHash = (
    Annotated[bytes, msgspec.Meta(min_length=1, max_length=MAX_HASH_BYTES)]
    | Annotated[int, msgspec.Meta(ge=0)]  # msgpack ints stop at uint64
)

# Where a copy lives, as events name it (vLLM's ``vllm.distributed.kv_events`` names).
MEDIUM_GPU = "GPU"  # the device cache: the only tier a request reads without a load
MEDIUM_CPU = "CPU"  # host memory (vLLM's OffloadingConnector, a kvroute host pool)
MEDIUM_STORAGE = "STORAGE"  # local disk (vLLM's file-system offloading tier)
LOWER_MEDIA = (MEDIUM_CPU, MEDIUM_STORAGE)  # the lower tiers routers price, fastest first
_KNOWN_MEDIA = frozenset((MEDIUM_GPU, *LOWER_MEDIA))
REMOTE = "REMOTE"  # vLLM's ``locality`` of a copy held away from the engine


def tier_name(medium: str | None, locality: str | None = None) -> str:
    """The tier a copy lives in, as routers key it. ``None`` (engines of one tier, which
    omit it) is the device; a known name in any case is its canonical name ("cpu", as
    LMCache spells it, is "CPU"); a copy vLLM marks ``locality="REMOTE"`` is
    ``"<medium>@REMOTE"``, its own tier; anything else is kept as given, a tier of unknown
    cost. Only ``"GPU"`` is the device: an unknown name never is."""
    if medium is None or medium == MEDIUM_GPU:
        name = MEDIUM_GPU
    else:
        up = medium.upper()
        name = up if up in _KNOWN_MEDIA else medium
    if locality is not None and locality.upper() == REMOTE:
        return f"{name}@{REMOTE}"
    return name


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Blocks that became findable by hash, in chain order.

    ``parent_block_hash`` is the hash of the block before ``block_hashes[0]`` (nil when the
    chain starts at block 0); each later hash's parent is the hash before it in the list.
    ``token_ids`` are the tokens of all stored blocks, concatenated. ``medium`` (and
    vLLM's ``locality``) name the tier that holds the copies (:func:`tier_name`). vLLM's
    offloading connector sends placeholders for lower-tier copies it has no metadata for:
    one hash, no parent, no tokens, ``block_size`` 0; they are valid events.
    """

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int | None = None
    locality: str | None = None  # vLLM: "LOCAL" or "REMOTE"; None: the engine's own


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Blocks that stopped being findable by hash (evicted, or their slot reused), in the
    tier ``medium`` (and ``locality``) names: one copy each, that tier's alone."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """The engine forgot every cached block, in every tier (a prefix-cache reset, a
    restart). An engine that keeps a lower tier across a device reset stores its blocks
    again after this event."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The events of one engine step, in the order they happened."""

    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = None


class _MapEventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = None


class MalformedBatchError(ValueError):
    """A payload that is not a valid event batch in any known layout."""


class BatchEncoder:
    """Encodes batches; ``layout="map"`` speaks to subscribers built on vLLM's newest main."""

    def __init__(self, layout: Literal["array", "map"] = "array") -> None:
        if layout not in ("array", "map"):
            raise ValueError(f"layout must be 'array' or 'map', got {layout!r}")
        self.layout = layout
        self._enc = msgspec.msgpack.Encoder()

    def encode(self, batch: EventBatch) -> bytes:
        if self.layout == "map":
            batch = _MapEventBatch(batch.ts, batch.events, batch.data_parallel_rank)
        return self._enc.encode(batch)


_default_encoder = BatchEncoder()
_fast = msgspec.msgpack.Decoder(EventBatch)
_fast_map = msgspec.msgpack.Decoder(_MapEventBatch)
_raw = msgspec.msgpack.Decoder()


# msgspec raises DecodeError/ValidationError, and UnicodeDecodeError (a ValueError) for a
# string that is not UTF-8; deep nesting can raise RecursionError.
_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, ValueError, RecursionError)


def encode_batch(batch: EventBatch) -> bytes:
    return _default_encoder.encode(batch)


def decode_batch(payload: bytes) -> EventBatch:
    """Decodes any known layout; raises :class:`MalformedBatchError` on anything else."""
    try:
        batch = _fast.decode(payload)
    except _DECODE_ERRORS:
        try:
            batch = _EventBatchFromMap(_fast_map.decode(payload))
        except _DECODE_ERRORS:
            batch = _decode_tolerant(payload)
    _check(batch)
    return batch


def _EventBatchFromMap(b: _MapEventBatch) -> EventBatch:  # noqa: N802 - reads as a cast
    return EventBatch(b.ts, b.events, b.data_parallel_rank)


def _decode_tolerant(payload: bytes) -> EventBatch:
    """Slow path: older vLLM layouts (tagged-array events, missing trailing fields)."""
    try:
        obj = _raw.decode(payload)
    except _DECODE_ERRORS as e:
        raise MalformedBatchError(f"not msgpack: {e}") from None
    if isinstance(obj, dict):
        ts, events, rank = obj.get("ts"), obj.get("events"), obj.get("data_parallel_rank")
    elif isinstance(obj, list) and len(obj) in (2, 3):
        ts, events = obj[0], obj[1]
        rank = obj[2] if len(obj) == 3 else None
    else:
        raise MalformedBatchError("batch is neither [ts, events, rank] nor a map")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise MalformedBatchError("batch ts is not a number")
    if not isinstance(events, list):
        raise MalformedBatchError("batch events is not a list")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise MalformedBatchError("data_parallel_rank is not an int")
    return EventBatch(float(ts), [_event(e) for e in events], rank)


_FIELDS: dict[str, tuple[type, tuple[str, ...]]] = {
    "BlockStored": (
        BlockStored,
        (
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
            "extra_keys",
            "group_idx",
        ),
    ),
    "BlockRemoved": (BlockRemoved, ("block_hashes", "medium", "group_idx")),
    "AllBlocksCleared": (AllBlocksCleared, ()),
}
# Fields that only maps carry (newer than every tagged-array layout): read by name.
_MAP_ONLY: dict[str, tuple[str, ...]] = {
    "BlockStored": ("locality",),
    "BlockRemoved": ("locality",),
}
_REQUIRED = {"BlockStored": 4, "BlockRemoved": 1, "AllBlocksCleared": 0}


def _event(raw: Any) -> KVCacheEvent:
    if isinstance(raw, dict):
        tag = raw.get("type")
        spec = _FIELDS.get(tag) if isinstance(tag, str) else None
        if spec is None:
            raise MalformedBatchError(f"unknown event type {tag!r}")
        names = spec[1]
        values = {k: raw[k] for k in (*names, *_MAP_ONLY.get(tag, ())) if k in raw}
        if any(k not in values for k in names[: _REQUIRED[tag]]):
            raise MalformedBatchError(f"{tag} lacks a required field")
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag = raw[0]
        spec = _FIELDS.get(tag)
        if spec is None:
            raise MalformedBatchError(f"unknown event type {tag!r}")
        names = spec[1]
        if not _REQUIRED[tag] <= len(raw) - 1 <= len(names):
            raise MalformedBatchError(f"{tag} has {len(raw) - 1} fields")
        values = dict(zip(names, raw[1:], strict=False))
    else:
        raise MalformedBatchError("event is neither a map nor a tagged array")
    cls = spec[0]
    defaults = {"lora_id": None, "medium": None, "lora_name": None, "parent_block_hash": None}
    for k, v in defaults.items():
        if k in names and k not in values:
            values[k] = v
    try:
        # Round-trip through msgspec so field types are checked exactly as on the fast path.
        return msgspec.convert(values, cls)
    except _DECODE_ERRORS as e:
        raise MalformedBatchError(f"{tag}: {e}") from None


def _check(batch: EventBatch) -> None:
    """Semantic checks msgspec's types cannot express."""
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            if ev.block_size < 0 or (ev.block_size == 0 and ev.token_ids):
                # 0 only for a placeholder without tokens (vLLM's offloading connector)
                raise MalformedBatchError("BlockStored.block_size must be positive")
            if not ev.block_hashes:
                raise MalformedBatchError("BlockStored without block hashes")
            if len(ev.token_ids) != len(ev.block_hashes) * ev.block_size:
                raise MalformedBatchError("BlockStored.token_ids length != blocks * block_size")
