"""Hypothesis fuzz: the decoder returns a batch or raises MalformedBatchError, nothing else."""

from __future__ import annotations

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    MalformedBatchError,
    decode_batch,
    encode_batch,
)

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])

hashes = st.one_of(st.binary(min_size=1, max_size=32), st.integers(0, 2**64 - 1))
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=12),
    st.binary(max_size=12),
    st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type"]),
)
msgpack_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6),
        st.dictionaries(
            st.one_of(
                st.text(max_size=20),
                st.sampled_from(
                    [
                        "type",
                        "block_hashes",
                        "parent_block_hash",
                        "token_ids",
                        "block_size",
                        "medium",
                        "ts",
                        "events",
                    ]
                ),
            ),
            inner,
            max_size=6,
        ),
    ),
    max_leaves=40,
)


def _check(raw: bytes) -> None:
    try:
        b = decode_batch(raw)
    except MalformedBatchError:
        return
    assert isinstance(b, EventBatch)
    for ev in b.events:
        assert isinstance(ev, (BlockStored, BlockRemoved, AllBlocksCleared))


@FUZZ
@given(st.binary(max_size=256))
def test_random_bytes(raw):
    _check(raw)


@FUZZ
@given(msgpack_values)
def test_random_msgpack_structures(obj):
    _check(msgspec.msgpack.encode(obj))


@st.composite
def batches(draw):
    events = []
    for _ in range(draw(st.integers(0, 5))):
        kind = draw(st.sampled_from(["s", "r", "c"]))
        if kind == "s":
            n = draw(st.integers(1, 4))
            bs = draw(st.integers(1, 8))
            events.append(
                BlockStored(
                    draw(st.lists(hashes, min_size=n, max_size=n)),
                    draw(st.one_of(st.none(), hashes)),
                    draw(st.lists(st.integers(0, 2**32 - 1), min_size=n * bs, max_size=n * bs)),
                    bs,
                    None,
                    draw(st.sampled_from(["GPU", "CPU", None])),
                    draw(st.one_of(st.none(), st.text(max_size=5))),
                )
            )
        elif kind == "r":
            events.append(BlockRemoved(draw(st.lists(hashes, min_size=1, max_size=4)), "GPU"))
        else:
            events.append(AllBlocksCleared())
    return EventBatch(
        draw(st.floats(0, 1e10)), events, draw(st.one_of(st.none(), st.integers(0, 8)))
    )


@FUZZ
@given(batches())
def test_valid_batches_roundtrip(b):
    assert decode_batch(encode_batch(b)) == b


@FUZZ
@given(batches(), st.data())
def test_corrupted_valid_batches(b, data):
    raw = bytearray(encode_batch(b))
    if not raw:
        return
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    _check(bytes(raw[:cut]))
