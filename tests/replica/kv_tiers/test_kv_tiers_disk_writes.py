"""The engine's disk tier writes on a writer thread (issue 38): with the disk held, the
engine still serves, and a block evicted to disk loads back from memory before its file
exists and from the file after, with the uncached output; a write that really fails is
announced (BlockRemoved STORAGE, engine thread) and recomputed; a reset with writes pending
leaves nothing behind."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvroute.events import MEDIUM_STORAGE, AllBlocksCleared, BlockRemoved, BlockStored, to_external
from kvroute.replica import EngineConfig, LLMEngine

from .test_kv_disk_writer import Gate
from .test_kv_tiers import BLOCK, BLOCK_BYTES, HIT, NUM_BLOCKS, prompts, run


def disk_engine(folder: Path, events: list, disk_blocks: int = 64) -> LLMEngine:
    config = EngineConfig(
        model="tiny",
        block_size=BLOCK,
        num_blocks=NUM_BLOCKS,
        kv_disk_path=str(folder),
        kv_disk_bytes=disk_blocks * BLOCK_BYTES,
    )
    return LLMEngine(config, event_sinks=[events.extend])


@pytest.fixture(scope="module")
def uncached() -> list[list[int]]:
    ref = LLMEngine(EngineConfig(model="tiny", block_size=BLOCK, num_blocks=256))
    return [run(ref, f"u{i}", p).outputs[0].token_ids for i, p in enumerate(prompts())]


def storage(events: list, kind: type) -> list:
    """The STORAGE events of a kind, each block hash apart, in order."""
    return [
        h for e in events if isinstance(e, kind) and e.medium == MEDIUM_STORAGE
        for h in e.block_hashes
    ]  # fmt: skip


def _position(events: list, kind: type, ext: object) -> int:
    return next(
        i for i, e in enumerate(events)
        if isinstance(e, kind) and e.medium == MEDIUM_STORAGE and ext in e.block_hashes
    )  # fmt: skip


def test_a_held_disk_holds_up_no_step_and_blocks_load_before_and_after_their_writes(
    uncached: list[list[int]], tmp_path: Path
) -> None:
    folder = tmp_path / "kv"
    events: list = []
    eng = disk_engine(folder, events)
    disk = eng.kv_tiers.disk
    gate = Gate(disk.store)
    ps = prompts()
    t0 = time.perf_counter()
    for i, p in enumerate(ps):
        assert run(eng, f"a{i}", p).outputs[0].token_ids == uncached[i]
    # every eviction only queued its write: the writer is stuck inside the first (30 s)
    assert time.perf_counter() - t0 < 20 and eng.kv_tiers.offload_seconds < 2
    assert gate.entered.is_set() and not gate.opened.is_set()
    assert not list(disk.path.glob("*.kvb")) and disk.num_pending == len(eng.kv_tiers.disk_meta)
    assert eng.stats()["kv_disk_pending"] > HIT // BLOCK
    hashes = eng.hasher.hash_blocks(ps[0])
    # announced when queued, and loadable from memory
    assert {to_external(h, eng.kv_cache_manager.block_pool.hash_form) for h in hashes[:9]} <= set(
        storage(events, BlockStored)
    )
    again = run(eng, "again", ps[0])
    assert again.outputs[0].token_ids == uncached[0]
    assert again.num_tier_cached_tokens == {MEDIUM_STORAGE: HIT}
    assert not list(disk.path.glob("*.kvb"))  # all of it came from the writer's memory
    gate.open()
    assert disk.flush(30) and disk.num_pending == 0
    assert all(disk.file_of(h).exists() for h in hashes[:9])
    eng.kv_cache_manager.block_pool.check_invariants()
    # evicted from the device once more (its disk copies stay), then loaded from the files
    for i, p in enumerate(ps[1:], 1):
        assert run(eng, f"b{i}", p).outputs[0].token_ids == uncached[i]
    final = run(eng, "final", ps[0])
    assert final.outputs[0].token_ids == uncached[0]
    assert final.num_tier_cached_tokens == {MEDIUM_STORAGE: HIT}
    stats = eng.stats()
    assert stats["kv_tier_load_failures"] == 0 and stats["kv_tier_disk_dropped"] == 0
    assert not storage(events, BlockRemoved)  # 64 blocks of room: nothing left the disk
    eng.close()


def test_a_failed_write_is_announced_and_its_block_recomputed(
    uncached: list[list[int]], tmp_path: Path
) -> None:
    """A real failure: the 4th block's temporary file has a folder in its place."""
    folder = tmp_path / "kv"
    events: list = []
    eng = disk_engine(folder, events)
    ps = prompts()
    hashes = eng.hasher.hash_blocks(ps[0])
    disk = eng.kv_tiers.disk
    (disk.path / (disk.file_of(hashes[3]).name + ".tmp")).mkdir()
    for i, p in enumerate(ps):
        run(eng, f"a{i}", p)
    assert eng.kv_tiers.disk.flush(10)
    eng.step()  # an idle step: its schedule polls the writer first, then publishes
    ext = to_external(hashes[3], eng.kv_cache_manager.block_pool.hash_form)
    stored, removed = storage(events, BlockStored), storage(events, BlockRemoved)
    assert stored.count(ext) == removed.count(ext) == 1  # announced, then withdrawn, once
    assert _position(events, BlockStored, ext) < _position(events, BlockRemoved, ext)
    assert hashes[3] not in eng.kv_tiers.disk_meta and hashes[3] not in eng.kv_tiers.disk
    again = run(eng, "again", ps[0])
    assert again.outputs[0].token_ids == uncached[0]
    assert again.num_tier_cached_tokens == {MEDIUM_STORAGE: 3 * BLOCK}  # 3 load, rest computed
    stats = eng.stats()
    assert stats["kv_tier_disk_write_failures"] == 1 and stats["kv_tier_load_failures"] == 0
    eng.close()


def test_a_reset_with_writes_pending_leaves_no_entry_and_no_file(
    uncached: list[list[int]], tmp_path: Path
) -> None:
    folder = tmp_path / "kv"
    events: list = []
    eng = disk_engine(folder, events, disk_blocks=12)  # small: evictions while pending
    disk = eng.kv_tiers.disk
    gate = Gate(disk.store)
    ps = prompts()
    for i, p in enumerate(ps):
        run(eng, f"a{i}", p)
        disk.store.check_invariants()  # within 12 blocks, pending writes counted
    assert disk.num_pending == len(disk) == 12 and storage(events, BlockRemoved)
    assert eng.reset_prefix_cache()
    assert isinstance(events[-1], AllBlocksCleared)
    assert not eng.kv_tiers.disk_meta and len(disk) == 0 and disk.num_pending == 0
    gate.open()  # the write in flight lands after the reset, and is removed
    assert disk.flush(10)
    assert not list(disk.path.iterdir())
    again = run(eng, "again", ps[0])  # nothing below the device any more: computed
    assert again.outputs[0].token_ids == uncached[0] and not again.num_tier_cached_tokens
    eng.close()
