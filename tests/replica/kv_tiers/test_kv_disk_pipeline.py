"""The disk fetcher's pipelined reads (issue 50: sealing's cost hidden behind the reads): a
run of blocks comes back byte for byte, each block read straight into the buffer handed on
(or opened straight into it), the next block's read under way while one is opened; a bad
block in the middle of a run (tampered, a FIFO, a read that hangs) stops the load there,
the blocks before it intact, within the deadline; a buffer a stuck read still holds is
never handed on again; buffers the loader let go of are reused."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvroute.events import MEDIUM_CPU, MEDIUM_STORAGE
from kvroute.replica.kv_tiers import disk_reads
from kvroute.replica.kv_tiers.disk import DiskStore, checksum
from kvroute.replica.kv_tiers.disk_reads import BlockBuffers, DiskFetcher, DiskReads
from kvroute.replica.kv_tiers.disk_writer import DiskWriter
from kvroute.replica.kv_tiers.tiers import LoadJob

SIZE = 8192
N = 10


def h(i: int) -> bytes:
    return (500 + i).to_bytes(16, "big")


def block(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, SIZE, dtype=np.uint8)


class Rig:
    """A store of ``N`` blocks written to files, its writer, bounded reads and a fetcher
    whose handoff collects the jobs it hands on."""

    def __init__(self, root: Path, encrypt: bool, ahead: int, deadline_s: float = 5.0) -> None:
        self.store = DiskStore(root, 1 << 30, encrypt=encrypt)
        for i in range(N):
            assert self.store.write_file(h(i), block(i), checksum(block(i)))
        self.writer = DiskWriter(self.store)
        self.reads = DiskReads(lambda x, n: self.store.read(x, n), deadline_s, max_readers=4)
        self.handed: list[LoadJob] = []
        self.landed = threading.Event()
        self.fetcher = DiskFetcher(self.writer, self.reads, SIZE, self._hand, ahead=ahead)

    def _hand(self, job: LoadJob) -> None:
        self.handed.append(job)
        self.landed.set()

    def load(self, media: list[str] | None = None, timeout: float = 30.0) -> LoadJob:
        media = media or [MEDIUM_STORAGE] * N
        job = LoadJob("r", [], media, [h(i) for i in range(N)], [None] * N)
        job.fetched = [None] * N
        self.landed.clear()
        self.fetcher.submit(job)
        assert self.landed.wait(timeout), "the fetcher never handed the job on"
        return self.handed.pop()

    def close(self) -> None:
        self.fetcher.close()
        self.writer.close()


@pytest.fixture(params=[True, False], ids=["sealed", "plain"])
def encrypt(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


@pytest.fixture
def rig(tmp_path: Path, encrypt: bool) -> Iterator[Rig]:
    r = Rig(tmp_path / "kv", encrypt, ahead=1)
    yield r
    r.close()


def fetched_bytes(job: LoadJob) -> list[bytes | None]:
    return [None if b is None else bytes(memoryview(b)) for b in job.fetched]


@pytest.mark.parametrize("ahead", [0, 1, 3])
def test_a_pipelined_run_comes_back_byte_for_byte(
    tmp_path: Path, encrypt: bool, ahead: int
) -> None:
    rig = Rig(tmp_path / "kv", encrypt, ahead)
    for _ in range(3):  # again, on reused buffers
        job = rig.load()
        assert fetched_bytes(job) == [block(i).tobytes() for i in range(N)]
    # blocks of other tiers are skipped, and left to the loader
    media = [MEDIUM_CPU, *([MEDIUM_STORAGE] * (N - 2)), MEDIUM_CPU]
    job = rig.load(media)
    want = [None, *(block(i).tobytes() for i in range(1, N - 1)), None]
    assert fetched_bytes(job) == want
    assert rig.reads.timeouts == rig.reads.stuck == rig.store.num_unauthentic == 0
    rig.close()


def test_blocks_still_in_the_writers_memory_come_back_among_files(
    tmp_path: Path, encrypt: bool
) -> None:
    rig = Rig(tmp_path / "kv", encrypt, ahead=1)
    pending = (2, 3, 7)
    for i in pending:  # their files gone; their writes queued, the writer held back
        rig.store.remove_file(h(i))
    gate = threading.Event()
    real_write, real_read = rig.store.write_file, rig.store.read_file
    files_read: list[bytes] = []

    def held(x: bytes, data: memoryview, digest: int) -> bool:
        assert gate.wait(30)
        return real_write(x, data, digest)

    def read_file(x: bytes, *args: object) -> bytes | None:
        files_read.append(x)
        return real_read(x, *args)  # type: ignore[arg-type]

    rig.store.write_file = held  # type: ignore[method-assign]
    rig.store.read_file = read_file  # type: ignore[method-assign]
    for i in pending:
        assert rig.writer.put(h(i), memoryview(block(i)), checksum(block(i))) == []
    assert rig.writer.num_pending == 3
    job = rig.load()
    assert fetched_bytes(job) == [block(i).tobytes() for i in range(N)]
    assert sorted(files_read) == [h(i) for i in range(N) if i not in pending]
    gate.set()
    assert rig.writer.flush(10)
    rig.close()


def test_a_tampered_block_mid_run_stops_the_load_there(rig: Rig) -> None:
    f = rig.store.file_of(h(5))
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0x10  # a flipped bit in the payload
    f.write_bytes(raw)
    job = rig.load()
    got = fetched_bytes(job)
    assert got[:5] == [block(i).tobytes() for i in range(5)]  # the run before it, intact
    assert got[5:] == [None] * (N - 5)
    assert rig.store.num_unauthentic == 1
    assert rig.reads.stuck == 0  # the read ahead of it answered and was let go


def test_another_blocks_file_mid_run_stops_the_load_there(rig: Rig) -> None:
    rig.store.file_of(h(4)).write_bytes(rig.store.file_of(h(1)).read_bytes())  # 1's, as 4
    job = rig.load()
    got = fetched_bytes(job)
    assert got[:4] == [block(i).tobytes() for i in range(4)] and got[4:] == [None] * (N - 4)
    assert rig.store.num_unauthentic == 1  # 1's bytes under 4's name fail to open


def test_a_fifo_mid_run_fails_only_from_there_without_blocking(rig: Rig) -> None:
    f = rig.store.file_of(h(6))
    f.unlink()
    os.mkfifo(f)  # no writer: a blocking open or read would hang forever
    t0 = time.monotonic()
    job = rig.load(timeout=5)
    assert time.monotonic() - t0 < 2.0  # refused on its fstat, well within the deadline
    got = fetched_bytes(job)
    assert got[:6] == [block(i).tobytes() for i in range(6)] and got[6:] == [None] * (N - 6)
    assert rig.store.num_refused == 1 and rig.reads.timeouts == 0


def test_a_hung_read_mid_run_fails_from_there_by_its_deadline_and_its_buffer_is_never_reused(
    tmp_path: Path, encrypt: bool
) -> None:
    rig = Rig(tmp_path / "kv", encrypt, ahead=1, deadline_s=0.5)
    released = threading.Event()
    held: list[memoryview] = []
    real = rig.store.read_file

    bodies: list[memoryview] = []  # every buffer a read was given

    def hangs(x: bytes, size: int, body: memoryview, reading=None) -> bytes | None:
        bodies.append(body)
        if x == h(4) and not released.is_set():
            held.append(body)
            assert released.wait(30)  # a bound: a test that never releases fails
        return real(x, size, body, reading)

    rig.store.read_file = hangs  # type: ignore[method-assign]
    t0 = time.monotonic()
    job = rig.load(timeout=10)
    assert time.monotonic() - t0 < 0.5 + 1.5  # its deadline, and little more
    got = fetched_bytes(job)
    assert got[:4] == [block(i).tobytes() for i in range(4)] and got[4:] == [None] * (N - 4)
    assert rig.reads.timeouts == 1 and rig.reads.stuck == 1  # the read ahead answered
    assert len(held) == 1
    stuck = np.frombuffer(held[0], np.uint8)
    # later loads (the disk answers for every other block) never get the stuck read's buffer
    # to read into, nor to hand on
    later = len(bodies)
    for _ in range(3):
        ok = rig.load(media=[MEDIUM_STORAGE] * 4 + [MEDIUM_CPU] * (N - 4))
        assert fetched_bytes(ok)[:4] == [block(i).tobytes() for i in range(4)]
        for b in ok.fetched[:4]:
            assert not np.shares_memory(np.asarray(b), stuck)
    assert len(bodies) == later + 12
    for body in bodies[later:]:
        assert not np.shares_memory(np.frombuffer(body, np.uint8), stuck)
    released.set()  # the stuck read returns: into its own buffer, nobody else's
    deadline = time.monotonic() + 10
    while rig.reads.stuck and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rig.reads.stuck == 0
    job = rig.load()
    assert fetched_bytes(job) == [block(i).tobytes() for i in range(N)]
    rig.close()


def test_the_next_read_is_under_way_while_a_block_is_opened(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(disk_reads, "HANDOFF_S", 5.0)  # wait for each read, however slow
    log: list[tuple[str, int]] = []
    index = {h(i): i for i in range(N)}
    real_read, real_open = rig.store.read_file, rig.store.open_body

    def read_file(x: bytes, size: int, body: memoryview, reading=None) -> bytes | None:
        def went() -> None:
            log.append(("reading", index[x]))
            if reading is not None:
                reading()

        return real_read(x, size, body, went)

    def open_body(x: bytes, *args: object) -> bool:
        log.append(("open", index[x]))
        return real_open(x, *args)  # type: ignore[arg-type]

    rig.store.read_file = read_file  # type: ignore[method-assign]
    rig.store.open_body = open_body  # type: ignore[method-assign]
    job = rig.load()
    assert fetched_bytes(job) == [block(i).tobytes() for i in range(N)]
    for k in range(N - 1):  # block k+1's read had reached its read before k was opened
        assert log.index(("reading", k + 1)) < log.index(("open", k)), log


def test_block_buffers_come_back_once_let_go_and_only_then() -> None:
    buffers = BlockBuffers(64, keep_bytes=64 * 3)
    a = buffers.take()
    a[:] = 1
    base = a.base
    assert len(buffers) == 0
    view = memoryview(a)  # a reader still holds it
    del a
    assert len(buffers) == 0
    del view
    assert len(buffers) == 1  # let go of: back for the next block
    b = buffers.take()
    assert b.base is base and len(buffers) == 0
    many = [buffers.take() for _ in range(5)]
    del b, many
    assert len(buffers) == 3  # no more kept than asked


def test_a_read_no_longer_needed_is_dropped_unstarted_or_waited_for() -> None:
    gate = threading.Event()
    ran: list[int] = []

    def read(i: int) -> int:
        ran.append(i)
        assert gate.wait(30)
        return i

    reads = DiskReads(read, deadline_s=5.0, max_readers=1)
    first = reads.submit(1)
    second = reads.submit(2)  # queued behind the first: the one reader is busy
    deadline = time.monotonic() + 5
    while not ran and time.monotonic() < deadline:
        time.sleep(0.001)
    assert reads.drain(second) and second.abandoned  # never started: dropped, not counted
    gate.set()
    assert reads.result(first) == 1
    assert reads.drain(reads.submit(3))  # started or not, it leaves nothing behind
    time.sleep(0.05)
    assert 2 not in ran and reads.timeouts == reads.stuck == 0
    reads.close()


def test_a_deadline_runs_from_submission() -> None:
    gate = threading.Event()
    reads = DiskReads(lambda: gate.wait(30), deadline_s=0.3, max_readers=2)
    req = reads.submit()
    time.sleep(0.4)  # the caller was busy past the deadline (opening another block)
    t0 = time.monotonic()
    assert reads.result(req) is None and time.monotonic() - t0 < 0.1
    assert reads.timeouts == 1 and reads.stuck == 1
    gate.set()
    reads.close()
