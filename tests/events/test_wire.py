"""The wire format: vLLM's shape on the way out, every vLLM layout on the way in."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from kvroute.events import (
    AllBlocksCleared,
    BatchEncoder,
    BlockRemoved,
    BlockStored,
    EventBatch,
    MalformedBatchError,
    decode_batch,
    encode_batch,
)

H1, H2, H3 = b"\x01" * 16, b"\x02" * 16, b"\x03" * 16


def sample_batch() -> EventBatch:
    return EventBatch(
        12.5,
        [
            BlockStored([H1, H2], None, list(range(32)), 16, None, "GPU", None),
            BlockStored([H3], H2, list(range(32, 48)), 16, None, "GPU", "adapter"),
            BlockRemoved([H1], "GPU"),
            AllBlocksCleared(),
        ],
        None,
    )


def test_encoded_batch_has_vllm_shape_for_a_plain_msgpack_reader():
    raw = msgspec.msgpack.decode(encode_batch(sample_batch()))
    assert isinstance(raw, list) and len(raw) == 3
    ts, events, rank = raw
    assert ts == 12.5 and rank is None
    assert events[0] == {
        "type": "BlockStored",
        "block_hashes": [H1, H2],
        "parent_block_hash": None,
        "token_ids": list(range(32)),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    assert events[1]["parent_block_hash"] == H2 and events[1]["lora_name"] == "adapter"
    assert events[2] == {"type": "BlockRemoved", "block_hashes": [H1], "medium": "GPU"}
    assert events[3] == {"type": "AllBlocksCleared"}


def test_roundtrip_both_layouts():
    b = sample_batch()
    assert decode_batch(encode_batch(b)) == b
    map_raw = BatchEncoder("map").encode(b)
    assert isinstance(msgspec.msgpack.decode(map_raw), dict)
    assert decode_batch(map_raw) == b


# vLLM's event types, restated from its documented definitions (vllm.distributed.kv_events),
# in its two historical layouts, to produce bytes the way a vLLM engine would.
class _OldBase(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class OldStored(_OldBase, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class OldRemoved(_OldBase, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class OldBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class NewStored(msgspec.Struct, omit_defaults=True, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class NewBatch(msgspec.Struct, omit_defaults=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def test_reads_vllm_tagged_array_events_with_int_hashes():
    raw = msgspec.msgpack.encode(
        OldBatch(
            1.0,
            [OldStored([11, 12], None, list(range(32)), 16, None, "GPU"), OldRemoved([11], "GPU")],
            0,
        )
    )
    b = decode_batch(raw)
    assert b.data_parallel_rank == 0
    assert b.events == [
        BlockStored([11, 12], None, list(range(32)), 16, None, "GPU", None),
        BlockRemoved([11], "GPU"),
    ]


def test_reads_vllm_oldest_layout_without_medium():
    raw = msgspec.msgpack.encode(
        [
            2.0,
            [
                ["BlockStored", [5], 4, list(range(16)), 16, None],
                ["BlockRemoved", [5]],
                ["AllBlocksCleared"],
            ],
        ]
    )
    b = decode_batch(raw)
    assert b.events[0] == BlockStored([5], 4, list(range(16)), 16, None, None, None)
    assert b.events[1] == BlockRemoved([5], None)
    assert isinstance(b.events[2], AllBlocksCleared)


def test_reads_vllm_newest_map_layout_and_ignores_unknown_fields():
    raw = msgspec.msgpack.encode(
        NewBatch(
            3.0,
            [
                NewStored(
                    [2**64 - 1],
                    None,
                    list(range(16)),
                    16,
                    None,
                    "GPU",
                    None,
                    extra_keys=[["salt"]],
                    kv_cache_spec_kind="full",
                )
            ],
            1,
        )
    )
    b = decode_batch(raw)
    assert b.ts == 3.0 and b.data_parallel_rank == 1
    ev = b.events[0]
    assert isinstance(ev, BlockStored) and ev.block_hashes == [2**64 - 1]
    assert ev.extra_keys == [["salt"]]


@pytest.mark.parametrize(
    "obj",
    [
        "not a batch",
        [],
        [1.0],
        ["ts", []],
        [1.0, "events"],
        [1.0, [], "rank"],
        [1.0, [{"type": "Nope"}]],
        [1.0, [{"no_type": 1}]],
        [1.0, [{"type": "BlockStored", "block_hashes": [1]}]],
        [1.0, [{"type": "BlockRemoved", "block_hashes": [-5], "medium": None}]],
        [1.0, [{"type": "BlockRemoved", "block_hashes": [b""], "medium": None}]],
        [1.0, [{"type": "BlockRemoved", "block_hashes": [b"x" * 65], "medium": None}]],
        [1.0, [{"type": "BlockRemoved", "block_hashes": ["str"], "medium": None}]],
        [1.0, [["BlockStored", [1], None, [1, 2, 3], 16, None, None, None]]],  # tokens != 16
        [1.0, [["BlockStored", [], None, [], 16, None, None, None]]],
        [1.0, [["BlockStored", [1], None, list(range(16)), 0, None, None, None]]],
        [1.0, [["BlockRemoved"]]],
        [1.0, [["BlockRemoved", [1], None, None, "extra"]]],
        [1.0, [42]],
        {"ts": 1.0},
    ],
)
def test_malformed_batches_raise_malformed_batch(obj):
    with pytest.raises(MalformedBatchError):
        decode_batch(msgspec.msgpack.encode(obj))


@pytest.mark.parametrize(
    "raw", [b"", b"\xc1", b"\x93\xcb", encode_batch(sample_batch())[:-3], b"\xdd\xff\xff\xff\xff"]
)
def test_garbage_and_truncated_bytes_raise_malformed_batch(raw):
    with pytest.raises(MalformedBatchError):
        decode_batch(raw)
