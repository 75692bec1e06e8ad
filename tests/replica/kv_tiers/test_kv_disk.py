"""The disk tier's store alone: LRU within its bytes, every damage read as a miss (sealed
or not), its own files wiped when it opens (a restarted replica starts empty)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvroute.replica.kv_tiers.disk import DiskStore, checksum


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def put(store: DiskStore, i: int, size: int = 100) -> list[bytes] | None:
    data = bytes([i % 256]) * size
    return store.put(h(i), data, checksum(data))


def test_lru_within_capacity(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 300)
    for i in range(3):
        assert put(store, i) == []
    store.touch(h(0))  # 1 is now the least recently used
    assert put(store, 3) == [h(1)]
    assert h(1) not in store and not store.file_of(h(1)).exists()
    assert [store.read(h(i), 100) for i in (0, 2, 3)] == [bytes([i]) * 100 for i in (0, 2, 3)]
    assert put(store, 9, size=301) is None  # larger than the whole store
    store.check_invariants()
    assert store.used_bytes == 300


@pytest.mark.parametrize("encrypt", [True, False])
@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "size", "foreign"])
def test_every_damage_reads_as_a_miss(tmp_path: Path, damage: str, encrypt: bool) -> None:
    store = DiskStore(tmp_path, 1000, encrypt=encrypt)
    put(store, 1)
    f = store.file_of(h(1))
    raw = bytearray(f.read_bytes())
    if damage == "truncate":
        f.write_bytes(raw[:-1])
    elif damage == "flip":
        raw[-1] ^= 1
        f.write_bytes(raw)
    elif damage == "delete":
        f.unlink()
    elif damage == "foreign":
        raw[0:4] = b"XXXX"
        f.write_bytes(raw)
    expected = 99 if damage == "size" else 100
    assert store.read(h(1), expected) is None
    assert store.read(h(1), 100) is None or damage == "size"


def test_a_store_opening_on_a_folder_wipes_its_own_files(tmp_path: Path) -> None:
    first = DiskStore(tmp_path, 1000)
    put(first, 1)
    put(first, 2)
    other = tmp_path / "notes.txt"
    other.write_text("not ours")
    second = DiskStore(tmp_path, 1000)
    assert second.num_wiped == 2 and len(second) == 0
    assert second.read(h(1), 100) is None
    assert other.exists()  # only its own files go
