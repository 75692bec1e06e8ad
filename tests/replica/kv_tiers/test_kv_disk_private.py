"""The disk tier's store keeps tenants' blocks theirs (issue 50): its folder 0700 and its
files 0600 as they are created, whatever the umask and the configured folder's modes;
blocks sealed so that neither their bytes nor another key give them back, and a file
renamed to another block's name fails; a FIFO or symlink in a block's place is refused
without blocking; the folder goes at close, and a deleted or replaced one is noticed."""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvroute.replica.kv_tiers import disk as kv_disk
from kvroute.replica.kv_tiers.disk import DiskStore, checksum
from kvroute.replica.kv_tiers.disk_writer import DiskWriter
from kvroute.replica.kv_tiers.seal import Sealer


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def block(i: int, size: int = 4096) -> bytes:
    return bytes((i * 7 + j * 13) % 256 for j in range(size))


def put(store: DiskStore, i: int, size: int = 4096) -> None:
    data = block(i, size)
    assert store.put(h(i), data, checksum(data)) == []


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def within(seconds: float, fn: Callable[[], object]) -> object:
    """``fn()``'s result, or a failure (not a hang) if it takes longer than ``seconds``."""
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(seconds)
    assert out, f"did not return within {seconds} s"
    return out[0]


@pytest.fixture
def open_umask() -> Iterator[None]:
    old = os.umask(0)  # the most permissive: whatever is private was created so
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.parametrize("root_exists", [False, True])
def test_folder_0700_and_files_0600_as_created_whatever_the_umask(
    tmp_path: Path, open_umask: None, monkeypatch: pytest.MonkeyPatch, root_exists: bool
) -> None:
    root = tmp_path / "kv"
    if root_exists:  # a shared folder, open to all: the store works in a private one inside
        root.mkdir(mode=0o777)
        assert mode(root) == 0o777
    seen: list[int] = []
    real = kv_disk._write_all

    def spy(fd: int, parts: list[bytes | memoryview]) -> None:  # the temporary file, as made
        seen.append(stat.S_IMODE(os.fstat(fd).st_mode))
        real(fd, parts)

    monkeypatch.setattr(kv_disk, "_write_all", spy)
    store = DiskStore(root, 1 << 20)
    writer = DiskWriter(store)
    for i in range(3):
        data = block(i)
        writer.put(h(i), memoryview(data), checksum(data))
    assert writer.flush(10)
    assert store.path.parent == root and mode(store.path) == 0o700
    files = list(store.path.iterdir())
    assert len(files) == 3 and {mode(f) for f in files} == {0o600}
    assert seen == [0o600] * 3
    assert mode(root) == (0o777 if root_exists else 0o700)
    writer.close()


@pytest.mark.parametrize("encrypt", [True, False])
def test_a_file_renamed_to_another_block_s_name_reads_as_a_miss(
    tmp_path: Path, encrypt: bool
) -> None:
    store = DiskStore(tmp_path, 1 << 20, encrypt=encrypt)
    put(store, 1)
    put(store, 2)
    os.replace(store.file_of(h(1)), store.file_of(h(2)))  # block 1's bytes under 2's name
    assert store.read(h(2), 4096) is None
    assert store.num_unauthentic == 1
    put(store, 3)
    assert store.read(h(3), 4096) == block(3)  # an untouched file reads


def test_a_sealed_file_holds_no_plaintext_and_no_other_key_opens_it(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 1 << 20, encrypt=True)
    plain = DiskStore(tmp_path / "plain", 1 << 20)  # the default
    put(store, 1)
    put(plain, 1)
    data = block(1)
    raw = store.file_of(h(1)).read_bytes()
    assert data[:64] in plain.file_of(h(1)).read_bytes()  # unsealed, the bytes are there
    assert not any(data[i : i + 64] in raw for i in range(0, len(data), 64))
    assert store.read(h(1), 4096) == data  # this process's key opens it
    header = kv_disk._SEALED_HEADER
    _, size, nonce = header.unpack_from(raw)
    assert Sealer().open(h(1), nonce, raw[header.size :], size) is None  # another key
    again = DiskStore(tmp_path, 1 << 20, encrypt=True)  # a restart: a new key, old files gone
    assert again.num_wiped == 1 and again.read(h(1), 4096) is None


@pytest.mark.parametrize("kind", ["fifo", "symlink", "folder"])
def test_a_block_that_is_not_a_regular_file_reads_as_a_miss_without_blocking(
    tmp_path: Path, kind: str
) -> None:
    store = DiskStore(tmp_path / "kv", 1 << 20)
    put(store, 1)
    f = store.file_of(h(1))
    outside = tmp_path / "elsewhere.kvb"
    outside.write_bytes(f.read_bytes())  # a valid sealed copy, reachable only by the link
    f.unlink()
    if kind == "fifo":
        os.mkfifo(f)  # no writer: a plain open() for reading would block forever
    elif kind == "symlink":
        os.symlink(outside, f)
    else:
        f.mkdir()
    assert within(5, lambda: store.read(h(1), 4096)) is None
    assert store.num_refused == (0 if kind == "symlink" else 1)  # a link is not even opened


def test_close_removes_the_folder_and_a_root_it_made(tmp_path: Path) -> None:
    made = tmp_path / "made" / "kv"
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "notes.txt").write_text("not ours")
    for root in (made, shared):
        store = DiskStore(root, 1 << 20)
        writer = DiskWriter(store)
        for i in range(3):
            data = block(i)
            writer.put(h(i), memoryview(data), checksum(data))
        assert writer.flush(10) and len(list(store.path.iterdir())) == 3
        writer.close()
        assert not store.path.exists()
    assert not made.exists() and made.parent.exists()  # only what the store made
    assert [p.name for p in shared.iterdir()] == ["notes.txt"]


def test_a_killed_store_s_folder_is_wiped_by_the_next_without_opening_a_fifo(
    tmp_path: Path,
) -> None:
    first = DiskStore(tmp_path, 1 << 20)  # never closed: its process was killed
    put(first, 1)
    put(first, 2)
    os.mkfifo(first.path / "stray.kvb")
    (tmp_path / "0123.kvb").write_bytes(b"an older version's loose file")
    second = within(5, lambda: DiskStore(tmp_path, 1 << 20))
    assert isinstance(second, DiskStore)
    assert second.num_wiped == 4 and not first.path.exists()
    assert [p.name for p in tmp_path.iterdir()] == [second.path.name]


@pytest.mark.parametrize("how", ["deleted", "replaced", "moved away"])
def test_a_lost_folder_is_noticed_and_nothing_more_is_written_there(
    tmp_path: Path, how: str
) -> None:
    store = DiskStore(tmp_path, 1 << 20)
    writer = DiskWriter(store)
    data = block(1)
    writer.put(h(1), memoryview(data), checksum(data))
    assert writer.flush(10)
    moved = tmp_path / "moved"
    if how == "deleted":
        for f in store.path.iterdir():
            f.unlink()
        store.path.rmdir()
    else:
        store.path.rename(moved)
        if how == "replaced":
            store.path.mkdir()
            (store.path / "theirs.txt").write_text("someone else's folder now")
    data2 = block(2)
    writer.put(h(2), memoryview(data2), checksum(data2))
    deadline = time.monotonic() + 10  # the writer checks at least every FOLDER_CHECK_S
    while writer.lost is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert writer.lost == how
    writer.close()
    if how != "deleted":  # our files went with the folder moved away; theirs stay
        assert not list(moved.glob("*.kvb*"))
    if how == "replaced":
        assert [p.name for p in store.path.iterdir()] == ["theirs.txt"]
