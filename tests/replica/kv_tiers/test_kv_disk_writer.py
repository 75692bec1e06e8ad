"""The disk tier's writer thread alone, over a real store in a real folder: a put returns
before its file exists and the block reads from memory meanwhile; capacity holds with
writes pending; an eviction, discard or clear of a pending block leaves no file; a full
queue drops; a real failed write is reported once."""

from __future__ import annotations

import random
import threading
from pathlib import Path

from kvroute.replica.kv_tiers.disk import DiskStore, checksum
from kvroute.replica.kv_tiers.disk_writer import DiskWriter


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def block(i: int, size: int = 100) -> bytes:
    return bytes([i % 256]) * size


def put(writer: DiskWriter, i: int, size: int = 100) -> list[bytes] | None:
    data = block(i, size)
    return writer.put(h(i), memoryview(data), checksum(data))


class Gate:
    """Holds the writer thread inside its next file write until opened: a disk that does
    not answer, on the writer thread only (the engine-side code runs unchanged)."""

    def __init__(self, store: DiskStore) -> None:
        self.opened = threading.Event()
        self.entered = threading.Event()
        real = store.write_file

        def slow(block_hash: bytes, data: memoryview, digest: int) -> bool:
            self.entered.set()
            self.opened.wait(30)  # a bound: a test that never opens fails, not hangs
            return real(block_hash, data, digest)

        store.write_file = slow  # type: ignore[method-assign]

    def open(self) -> None:
        self.opened.set()


def files(folder: Path) -> set[str]:
    return {f.name for f in folder.iterdir()}


def test_a_pending_block_reads_from_memory_then_from_its_file(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 1000)
    writer = DiskWriter(store)
    gate = Gate(store)
    assert put(writer, 1) == []
    assert gate.entered.wait(10)
    assert not store.file_of(h(1)).exists() and writer.num_pending == 1
    assert h(1) in writer and writer.read(h(1), 100) == block(1)
    assert writer.read(h(1), 99) is None  # checked like a file: wrong size
    gate.open()
    assert writer.flush(10)
    assert writer.num_pending == 0 and store.file_of(h(1)).exists()
    assert writer.read(h(1), 100) == block(1) == store.read(h(1), 100)
    assert writer.poll() == [] and writer.stats["written"] == 1
    writer.close()


def test_pending_bytes_that_change_fail_their_checksum(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 1000)
    writer = DiskWriter(store)
    gate = Gate(store)
    data = bytearray(block(1))
    writer.put(h(1), memoryview(data), checksum(data))
    data[50] ^= 1  # damage in memory: a load must not take it
    assert writer.read(h(1), 100) is None
    gate.open()
    writer.close()


def test_capacity_holds_and_files_match_entries_under_many_writes(tmp_path: Path) -> None:
    """Random puts, discards and touches while the writer is held and released: the count
    never passes capacity, and once drained the folder holds exactly the entries."""
    rng = random.Random(5)
    store = DiskStore(tmp_path, 1000)
    writer = DiskWriter(store)
    gate = Gate(store)
    for step in range(600):
        i = rng.randrange(40)
        op = rng.random()
        if op < 0.7:
            put(writer, i, size=rng.choice((100, 150, 250)))
        elif op < 0.85:
            writer.discard(h(i))
        else:
            writer.touch(h(i))
        store.check_invariants()  # used_bytes adds up, pending writes counted, <= capacity
        if step == 300:
            gate.open()
    assert writer.flush(10)
    assert files(store.path) == {store.file_of(k).name for k in store.entries}
    on_disk = sum(store.file_of(k).stat().st_size for k in store.entries)
    assert on_disk == sum(store.file_bytes(n) for n in store.entries.values())
    assert store.used_bytes <= 1000
    for k, size in store.entries.items():
        assert writer.read(k, size) == block(k[-1], size)
    writer.close()


def test_a_block_evicted_while_its_write_is_pending_leaves_no_file(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 300)
    writer = DiskWriter(store)
    gate = Gate(store)
    put(writer, 1)  # in flight: the writer is inside its write
    assert gate.entered.wait(10)
    put(writer, 2)  # queued
    put(writer, 3)
    assert put(writer, 4) == [h(1)] and put(writer, 5) == [h(2)]  # in flight, then queued
    assert writer.read(h(1), 100) is None or writer.read(h(1), 100) == block(1)
    assert store.used_bytes == 300
    gate.open()
    assert writer.flush(10)
    assert files(store.path) == {store.file_of(h(i)).name for i in (3, 4, 5)}
    assert writer.poll() == []  # the cancelled writes report nothing
    writer.close()


def test_a_full_queue_drops_the_block_and_keeps_no_entry(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 10_000)
    writer = DiskWriter(store, max_queue_bytes=300)
    gate = Gate(store)
    assert all(put(writer, i) == [] for i in range(3))
    assert put(writer, 3) is None  # 400 bytes would wait: dropped, not waited for
    assert h(3) not in writer and writer.stats["dropped"] == 1 and store.used_bytes == 300
    gate.open()
    assert writer.flush(10)
    assert put(writer, 3) == []  # room again once the writer caught up
    assert writer.flush(10) and len(files(store.path)) == 4
    writer.close()


def test_a_failed_write_is_reported_once_and_forgotten(tmp_path: Path) -> None:
    """A real failure: a folder where the write's temporary file must go."""
    store = DiskStore(tmp_path, 1000)
    writer = DiskWriter(store)
    (store.path / (store.file_of(h(2)).name + ".tmp")).mkdir()
    for i in range(3):
        put(writer, i)
    assert writer.flush(10)
    assert writer.read(h(2), 100) is None  # nothing in memory, no file
    assert h(2) in writer  # still counted until the engine thread polls
    assert writer.poll() == [h(2)] and writer.poll() == []
    assert h(2) not in writer and store.used_bytes == 200
    assert writer.stats == {"written": 2, "write_failures": 1, "dropped": 0}
    # a failure the engine already acted on (a load missed it and discarded it): silent
    (store.path / (store.file_of(h(7)).name + ".tmp")).mkdir()
    put(writer, 7)
    assert writer.flush(10)
    assert writer.discard(h(7)) and writer.flush(10)
    assert writer.poll() == []
    writer.close()


def test_clear_with_writes_pending_leaves_no_entry_and_no_file(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 10_000)
    writer = DiskWriter(store)
    gate = Gate(store)
    for i in range(20):
        put(writer, i)
    assert gate.entered.wait(10)
    writer.clear()  # one write in flight, 19 queued
    assert len(writer) == 0 and writer.num_pending == 0 and store.used_bytes == 0
    assert writer.read(h(5), 100) is None
    gate.open()
    assert writer.flush(10)
    assert files(store.path) == set()
    assert writer.poll() == []
    put(writer, 1)  # a put after the clear is kept
    assert writer.flush(10) and files(store.path) == {store.file_of(h(1)).name}
    writer.close()
