"""Blocks in and out of the KV cache a chunk at a time (the tiers' loads and evictions,
the transfer plane's reads): every layer's K and V lands in the right block, whatever the
ids' order and however many chunks a load spans; a load from each tier, in chunks of 3 or
one, and a host copy damaged mid-chunk give the outputs an engine with room for everything
gives (on the CPU, and on CUDA where there is one)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kvroute.replica import EngineConfig, LLMEngine
from kvroute.replica.kv_tiers.tiers import KVTiers
from kvroute.replica.kv_transfer.sender import BlockReader

from .test_kv_tiers import BLOCK, BLOCK_BYTES, HIT, NUM_BLOCKS, prompts, run, tier_configs

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


def caches(device: str, layers: int = 3, num_blocks: int = 40) -> list[tuple[torch.Tensor, ...]]:
    """Random bf16 K and V caches laid out as the engine's: [blocks, block size, heads, dim]."""
    g = torch.Generator().manual_seed(1)
    shape = (num_blocks, 4, 2, 8)
    return [
        tuple(torch.randn(shape, generator=g).to(torch.bfloat16).to(device) for _ in "kv")
        for _ in range(layers)
    ]


def block_bytes(kv: list[tuple[torch.Tensor, ...]], block_id: int) -> bytes:
    return b"".join(t[block_id].cpu().contiguous().view(torch.uint8).numpy().tobytes()
                    for pair in kv for t in pair)  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
def test_chunked_copies_in_and_out_move_each_block_whole(device: str) -> None:
    kv = caches(device)
    tiers = KVTiers(kv, host_bytes=1 << 20, measure=False)
    reader = BlockReader(kv)
    tiers._chunk_blocks = reader.chunk_blocks = 3  # several chunks and a short last one
    if tiers.cuda:
        tiers._stage = tiers._stage[:3]
    ids = [17, 2, 30, 3, 9, 25, 11]  # out of order, not contiguous
    rng = random.Random(0)
    datas = [torch.tensor(list(rng.randbytes(tiers.block_bytes)), dtype=torch.uint8)
             for _ in ids]  # fmt: skip
    if tiers.cuda:
        datas = [d.pin_memory() for d in datas]
    untouched = {b: block_bytes(kv, b) for b in range(40) if b not in ids}
    for first in range(0, len(ids), 3):  # as the loader goes: a chunk at a time
        tiers._copy_in_blocks(ids[first : first + 3], datas[first : first + 3], tiers._rows)
    if tiers.cuda:
        torch.cuda.synchronize()
    for b, d in zip(ids, datas, strict=True):
        assert block_bytes(kv, b) == d.numpy().tobytes(), b
    assert all(block_bytes(kv, b) == raw for b, raw in untouched.items())
    copies = tiers._copy_out_blocks(ids)  # eviction's copies, a chunk at a time on CUDA
    for _, ready in copies:
        if ready is not None:
            ready.synchronize()
    assert [c.numpy().tobytes() for c, _ in copies] == [d.numpy().tobytes() for d in datas]
    outs = [reader.buffer() for _ in ids]
    for first in range(0, len(ids), 3):
        reader.read_many(ids[first : first + 3], outs[first : first + 3])
    assert [o.numpy().tobytes() for o in outs] == [d.numpy().tobytes() for d in datas]
    tiers.close()


_UNCACHED: dict[str, list[list[int]]] = {}


def uncached_on(device: str) -> list[list[int]]:
    """Each prompt's greedy output from an engine on ``device`` with room for all."""
    if device not in _UNCACHED:
        cfg = EngineConfig(
            model="tiny", dtype="float32", block_size=BLOCK, num_blocks=256, device=device
        )
        ref = LLMEngine(cfg)
        _UNCACHED[device] = [
            run(ref, f"u{i}", p).outputs[0].token_ids for i, p in enumerate(prompts())
        ]
    return _UNCACHED[device]


def tier_engine(device: str, chunk: int | None, **tiers: object) -> LLMEngine:
    """A small pool over ``tiers``; ``chunk``: blocks a load's or an eviction's chunk holds
    (None: as many as STAGE_BYTES holds, more than any load here)."""
    eng = LLMEngine(
        EngineConfig(
            model="tiny", dtype="float32", block_size=BLOCK, num_blocks=NUM_BLOCKS,
            device=device, **tiers,
        )  # type: ignore[arg-type]
    )  # fmt: skip
    if chunk is not None:
        eng.kv_tiers._chunk_blocks = chunk
    return eng


# Chunks of 3: far smaller than a load (9 blocks) and than an admission's evictions.
CHUNKS = [
    pytest.param("cpu", 3, id="cpu-chunks-of-3"),
    pytest.param("cuda", 3, marks=CUDA, id="cuda-chunks-of-3"),
    pytest.param("cuda", None, marks=CUDA, id="cuda-one-chunk"),
]


@pytest.mark.parametrize(("device", "chunk"), CHUNKS)
@pytest.mark.parametrize("tiers", ["host", "disk", "host+disk"])
def test_a_load_from_each_tier_gives_the_uncached_output(
    device: str, chunk: int | None, tiers: str, tmp_path: Path
) -> None:
    uncached = uncached_on(device)
    config, media = tier_configs(tmp_path)[tiers]
    eng = tier_engine(device, chunk, **config)
    ps = prompts()
    for i, p in enumerate(ps):
        assert run(eng, f"a{i}", p).outputs[0].token_ids == uncached[i]
    again = run(eng, "again", ps[0])
    assert again.outputs[0].token_ids == uncached[0]
    assert set(again.num_tier_cached_tokens) == media
    assert sum(again.num_tier_cached_tokens.values()) == HIT
    assert eng.stats()["kv_tier_load_failures"] == 0


@pytest.mark.parametrize(("device", "chunk"), CHUNKS)
def test_a_host_copy_damaged_mid_chunk_loads_the_blocks_before_it(
    device: str, chunk: int | None
) -> None:
    eng = tier_engine(device, chunk, kv_host_bytes=64 * BLOCK_BYTES)
    ps = prompts()
    for i, p in enumerate(ps):
        run(eng, f"a{i}", p)
    hashes = eng.hasher.hash_blocks(ps[0])
    entry = eng.kv_tiers.host[hashes[4]]  # the middle of the second chunk of 3
    entry.seal()
    entry.data[100] ^= 0x01  # after its checksum: caught at load
    again = run(eng, "again", ps[0])
    assert again.outputs[0].token_ids == uncached_on(device)[0]
    assert again.num_tier_cached_tokens == {"CPU": 4 * BLOCK}
    assert eng.stats()["kv_tier_load_failures"] == 1
