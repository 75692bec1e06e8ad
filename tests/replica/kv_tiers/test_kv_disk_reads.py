"""Disk reads with a deadline (issue 50: a hung disk held returning conversations for good):
a read that does not answer in time is a miss and its reader is abandoned; with every
reader stuck the disk is unresponsive (reads refused at once, no disk loads offered) until
one answers; each episode is logged once; and a host-tier load never waits behind a hung
disk read."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest
import torch

from kvroute.events import MEDIUM_CPU, MEDIUM_STORAGE
from kvroute.replica.core.block_pool import BlockPool
from kvroute.replica.kv_tiers.disk_reads import DiskReads
from kvroute.replica.kv_tiers.tiers import KVTiers


class HungDisk:
    """A read function whose reads of any block but ``b"ok"`` hang until released."""

    def __init__(self) -> None:
        self.released = threading.Event()

    def __call__(self, block_hash: bytes, size: int) -> bytearray | None:
        if block_hash != b"ok":
            assert self.released.wait(30)  # a bound: a test that never releases fails
        return bytearray(b"x" * size)


def warnings_of(caplog: pytest.LogCaptureFixture, text: str) -> int:
    return sum(text in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_a_hung_read_misses_by_its_deadline_and_all_stuck_is_unresponsive_until_one_answers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    disk = HungDisk()
    reads = DiskReads(disk, deadline_s=0.2, max_readers=2)
    assert reads.read(b"ok", 3) == b"xxx"
    t0 = time.monotonic()
    assert reads.read(b"a", 3) is None
    assert time.monotonic() - t0 < 2.0
    assert (reads.timeouts, reads.stuck, reads.unresponsive) == (1, 1, False)
    assert reads.read(b"ok", 3) == b"xxx"  # another reader serves while one hangs
    assert reads.read(b"b", 3) is None
    assert (reads.timeouts, reads.stuck, reads.unresponsive) == (2, 2, True)
    t0 = time.monotonic()
    assert reads.read(b"ok", 3) is None  # refused at once: nobody left to read
    assert time.monotonic() - t0 < 0.1 and reads.refused == 1
    disk.released.set()  # the disk answers again
    deadline = time.monotonic() + 10
    while reads.stuck and time.monotonic() < deadline:
        time.sleep(0.01)
    assert reads.stuck == 0 and not reads.unresponsive
    assert reads.read(b"ok", 3) == b"xxx"
    # one episode, one line for each of its turns
    assert warnings_of(caplog, "did not answer") == 1
    assert warnings_of(caplog, "unresponsive") == 1
    assert warnings_of(caplog, "answered again") == 1
    reads.close()


BLOCK_SHAPE = (16, 4, 2, 8)  # 16 blocks of 4 tokens, 2 heads of 8: 256 bytes a layer's K


def tiers_with_a_hung_disk(tmp_path: Path) -> tuple[KVTiers, list[bytes], HungDisk]:
    """Tiers with a host tier of 2 blocks over a disk: of 4 blocks evicted, the first 2
    went on to disk (their files written), the last 2 are in the host tier. Every disk read
    of a file hangs, and gives up after 1 s."""
    kv = [(torch.randn(BLOCK_SHAPE), torch.randn(BLOCK_SHAPE)) for _ in range(2)]
    block_bytes = 2 * 2 * 4 * 2 * 8 * 4
    tiers = KVTiers(
        kv,
        host_bytes=2 * block_bytes,
        disk_path=str(tmp_path / "kv"),
        disk_bytes=64 * block_bytes,
        disk_read_timeout_s=1.0,
        measure=False,
    )
    tiers.attach(BlockPool(16))
    hashes = [i.to_bytes(16, "big") for i in range(4)]
    for x in hashes:
        tiers.on_cached([x], None, [1, 2, 3, 4], 4, None)
    tiers.offload(list(enumerate(hashes)))
    assert tiers.disk is not None and tiers.disk.flush(10)
    assert tiers.lookup(hashes, 0, 4) == [MEDIUM_STORAGE] * 2 + [MEDIUM_CPU] * 2
    disk = HungDisk()
    real = tiers.disk.store.read_file

    def hung(block_hash: bytes, size: int, body: memoryview, reading=None) -> bytes | None:
        disk(b"", size)  # hangs until released
        return real(block_hash, size, body, reading)

    tiers.disk.store.read_file = hung  # type: ignore[method-assign]
    return tiers, hashes, disk


def test_a_host_load_does_not_wait_behind_a_hung_disk_read(tmp_path: Path) -> None:
    tiers, hashes, disk = tiers_with_a_hung_disk(tmp_path)
    on_disk = tiers.prepare("returning", hashes[:1])
    tiers.start(on_disk, [8])
    time.sleep(0.1)  # its read has started, and hangs
    in_host = tiers.prepare("other", hashes[2:3])
    tiers.start(in_host, [9])
    assert in_host.done.wait(0.8) and in_host.num_ok == 1  # before the disk's deadline
    assert not on_disk.done.is_set()
    assert torch.equal(tiers.tensors[0][9], tiers.tensors[0][2])  # the host copy landed
    assert on_disk.done.wait(10)  # its read gave up: the request recomputes that block
    assert on_disk.num_ok == 0 and on_disk.failed == hashes[0]
    counters = tiers.counters()
    assert counters["disk_read_timeouts"] == 1 and counters["disk_readers_stuck"] == 1
    disk.released.set()
    tiers.close()


def test_an_unresponsive_disk_offers_no_loads_until_a_read_answers(tmp_path: Path) -> None:
    tiers, hashes, disk = tiers_with_a_hung_disk(tmp_path)
    assert tiers.disk_reads is not None
    tiers.disk_reads.max_readers = 1  # one hung read is all of them
    job = tiers.prepare("returning", hashes[1:2])
    tiers.start(job, [8])
    assert job.done.wait(10) and job.failed == hashes[1]
    assert hashes[0] in tiers.disk_meta  # still held, but not offered
    assert tiers.lookup(hashes, 0, 4) == []
    assert tiers.counters()["disk_unresponsive"] == 1
    disk.released.set()
    deadline = time.monotonic() + 10
    while tiers.disk_reads.unresponsive and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tiers.lookup(hashes, 0, 1) == [MEDIUM_STORAGE]
    assert tiers.counters()["disk_unresponsive"] == 0
    tiers.close()
