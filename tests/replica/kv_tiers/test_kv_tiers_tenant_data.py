"""Issue 50's findings on the disk tier, through the real engine on ``tiny``:

1. a foreign reader of the disk folder reads a tenant's prompt straight back from its
   blocks (layer 0's V of a token is a function of the token alone, so with the public
   weights each row names its token): it works on unsealed files, not on sealed ones, and
   the folder is gone once the engine closes;
2. a block file replaced by a FIFO (a hung mount's stand-in) costs a recompute, at once;
   a disk read that hangs costs one after its deadline, and a host-tier load beside it
   does not wait for it;
3. a deleted folder turns the tier off with a warning, a stat and a BlockRemoved STORAGE
   for what it held, and the engine serves on;

and the engine thread's end (a replica's shutdown, or its engine's failure) removes the
folder: the tenants' blocks do not outlive the engine that holds them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvroute.events import MEDIUM_STORAGE, BlockRemoved, BlockStored
from kvroute.events.load import DISK_OFF, DISK_OK
from kvroute.replica import AsyncLLMEngine, EngineConfig, EngineDeadError, LLMEngine
from kvroute.replica.engine.llm_engine import EngineOutput
from kvroute.replica.kv_tiers.disk import HEADER_BYTES
from kvroute.replica.kv_tiers.seal import Sealer

from . import test_kv_tiers
from .test_kv_tiers import BLOCK, BLOCK_BYTES, GREEDY, NUM_BLOCKS, engine, prompts, run

uncached = test_kv_tiers.uncached  # each prompt's output with room for all (a fixture)

SECRET = b"TENANT-B SECRET: my password is hunter2. Keep it safe, assistant, please!!"
WIDE = 16  # the attack's block size: a block holds a good part of the secret
ROW = 4 * 32  # tiny's K/V heads x head_dim: one token's row of a layer's V, in floats


def run_within(eng: LLMEngine, rid: str, prompt: list[int], seconds: float) -> EngineOutput:
    """``run``, failing (not hanging) if the request is not done within ``seconds``."""
    eng.add_request(rid, prompt, GREEDY)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for out in eng.step():
            if out.request_id == rid and out.finished:
                return out
    raise AssertionError(f"{rid} not done within {seconds} s")


@pytest.fixture(scope="module")
def v0_of_token() -> np.ndarray:
    """The attacker's table, from the public weights alone: layer 0's V row of every byte
    token (a prompt of all 256, through an engine of their own)."""
    ref = LLMEngine(EngineConfig(model="tiny", dtype="float32", block_size=WIDE, num_blocks=40))
    vocab = list(range(256))
    run(ref, "table", vocab)
    pool, v0 = ref.kv_cache_manager.block_pool, ref.runner.kv_caches[0][1]
    rows = [v0[pool.get_cached_block(h).block_id] for h in ref.hasher.hash_blocks(vocab)]
    return np.concatenate([r.reshape(WIDE, ROW).numpy() for r in rows])


def recover(raw: bytes, table: np.ndarray) -> tuple[int, ...] | None:
    """A block's tokens from its file's bytes, as the review's script did: past a header
    (either format's size: 64 bytes now, 20 or 24 before) and layer 0's K, each V row is
    matched to the nearest row of the table; None unless every row matches."""
    span = WIDE * ROW * 4
    for header in (20, 24, HEADER_BYTES):
        v = np.frombuffer(raw[header + span : header + 2 * span], dtype=np.float32)
        if v.size != WIDE * ROW:
            continue
        with np.errstate(invalid="ignore", over="ignore"):  # ciphertext as floats: NaNs
            dist = np.abs(v.reshape(WIDE, 1, ROW) - table[None]).max(-1)
        best = dist.argmin(1)
        if (dist[np.arange(WIDE), best] < 1e-4).all():
            return tuple(int(t) for t in best)
    return None


@pytest.mark.parametrize("encrypt", [False, True])
def test_a_foreign_reader_reads_a_prompt_back_only_from_unsealed_blocks(
    tmp_path: Path, v0_of_token: np.ndarray, encrypt: bool
) -> None:
    root = tmp_path / "kv"
    eng = LLMEngine(
        EngineConfig(
            model="tiny",
            dtype="float32",
            block_size=WIDE,
            num_blocks=12,
            kv_disk_path=str(root),
            kv_disk_bytes=1 << 24,
            kv_disk_encrypt=encrypt,
        )
    )
    secret = list(SECRET)
    hashes = eng.hasher.hash_blocks(secret)
    run(eng, "tenant-b", secret)
    for i in range(3):  # other tenants' work pushes it out of the device, on to the disk
        run(eng, f"filler{i}", [(i * 31 + j) % 200 + 32 for j in range(100)])
    assert eng.kv_tiers.lookup(hashes, 0, len(hashes)) == [MEDIUM_STORAGE] * len(hashes)
    disk = eng.kv_tiers.disk
    assert disk.flush(10)
    # a reader who got the folder's bytes (a backup, a leftover, root): every file
    files = list(root.rglob("*.kvb"))
    recovered = {t for f in files if (t := recover(f.read_bytes(), v0_of_token)) is not None}
    blocks = [tuple(secret[i * WIDE : (i + 1) * WIDE]) for i in range(len(hashes))]
    if not encrypt:
        assert set(blocks) <= recovered  # the attack works: the prompt read straight back
        assert b"hunter2" in b"".join(bytes(b) for b in blocks if b in recovered)
    else:
        assert not recovered
        block_bytes = eng.kv_tiers.block_bytes
        for h in hashes:
            plain = disk.store.read(h, block_bytes)  # the oracle: this process's key
            raw = disk.store.file_of(h).read_bytes()
            assert plain is not None and len(raw) > block_bytes
            assert not any(plain[i : i + 256] in raw for i in range(0, block_bytes, 4096))
            assert Sealer().open(h, raw[12:24], raw[24:], block_bytes) is None  # no key
    eng.close()
    assert not root.exists()  # tenants' data does not outlive the engine


def test_a_fifo_in_a_block_s_place_costs_a_recompute_at_once(
    uncached: list[list[int]], tmp_path: Path
) -> None:
    eng = engine(kv_disk_path=str(tmp_path / "kv"), kv_disk_bytes=64 * BLOCK_BYTES)
    ps = prompts()
    for i, p in enumerate(ps):
        run(eng, f"a{i}", p)
    hashes = eng.hasher.hash_blocks(ps[0])
    assert eng.kv_tiers.disk.flush(10)
    victim = eng.kv_tiers.disk.file_of(hashes[3])
    victim.unlink()
    os.mkfifo(victim)  # no writer, ever: a plain open() for reading never returns
    t0 = time.monotonic()
    again = run_within(eng, "again", ps[0], 20)
    assert time.monotonic() - t0 < 5
    assert again.outputs[0].token_ids == uncached[0]
    assert again.num_tier_cached_tokens == {MEDIUM_STORAGE: 3 * BLOCK}  # 3 load, the rest not
    stats = eng.stats()
    assert stats["kv_tier_disk_refused_files"] == 1 and stats["kv_tier_load_failures"] == 1
    assert run_within(eng, "next", ps[3], 20).outputs[0].token_ids == uncached[3]
    eng.close()


def test_a_hung_disk_read_is_recomputed_after_its_deadline_and_delays_no_other_load(
    uncached: list[list[int]], tmp_path: Path
) -> None:
    """A host tier of 12 blocks over the disk: the first prompt's head is in the host, its
    tail on disk; the second prompt is in the host (the first's load evicts device blocks,
    which push some of it on to the disk). Reads of the first prompt's files hang; the
    second's load, from the host and the files that answer, lands meanwhile."""
    eng = engine(
        kv_host_bytes=12 * BLOCK_BYTES,
        kv_disk_path=str(tmp_path / "kv"),
        kv_disk_bytes=64 * BLOCK_BYTES,
        kv_disk_read_timeout_s=3.0,
    )
    ps = prompts()
    for i, p in enumerate(ps):
        run(eng, f"a{i}", p)
    tiers = eng.kv_tiers
    assert tiers.disk.flush(10)
    assert tiers.lookup(eng.hasher.hash_blocks(ps[0]), 0, 9) == ["CPU"] + [MEDIUM_STORAGE] * 8
    assert tiers.lookup(eng.hasher.hash_blocks(ps[1]), 0, 9) == ["CPU"] * 9
    released = threading.Event()
    real = tiers.disk.store.read_file
    stuck = set(eng.hasher.hash_blocks(ps[0]))

    def hung(block_hash: bytes, size: int, body: memoryview, reading=None) -> bytes | None:
        if block_hash in stuck:
            released.wait(60)  # files that do not answer (a bound: never a hung test)
        return real(block_hash, size, body, reading)

    tiers.disk.store.read_file = hung  # type: ignore[method-assign]
    eng.add_request("returning", ps[0], GREEDY)
    eng.step()
    assert "returning" in eng.scheduler.loading  # waits on the disk, out of the queue
    t0 = time.monotonic()
    other = run_within(eng, "other", ps[1], 20)  # its load comes from the host tier
    assert time.monotonic() - t0 < 2.5 and "returning" in eng.scheduler.loading
    assert other.outputs[0].token_ids == uncached[1]
    assert sum(other.num_tier_cached_tokens.values()) == 9 * BLOCK  # loaded, not computed
    final = None
    deadline = time.monotonic() + 20
    while final is None and time.monotonic() < deadline:
        final = next((o for o in eng.step() if o.request_id == "returning" and o.finished), None)
    assert final is not None, "the returning request never finished"
    assert final.outputs[0].token_ids == uncached[0]
    assert final.num_tier_cached_tokens == {"CPU": BLOCK}  # the host head, then recomputed
    stats = eng.stats()
    # the first disk block's read, and the next one's (read ahead, beside it): both hung
    assert stats["kv_tier_disk_read_timeouts"] == 2 and stats["kv_tier_load_failures"] == 1
    report = eng.scheduler.load_report()  # what routers (and their /metrics) are told
    assert (report.kv_disk_state, report.kv_disk_read_timeouts) == (DISK_OK, 2)
    released.set()
    eng.close()


def test_a_deleted_folder_turns_the_tier_off_with_a_warning_and_a_stat(
    uncached: list[list[int]], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    events: list = []
    eng = LLMEngine(
        EngineConfig(
            model="tiny",
            dtype="float32",
            block_size=BLOCK,
            num_blocks=NUM_BLOCKS,
            kv_disk_path=str(tmp_path / "kv"),
            kv_disk_bytes=64 * BLOCK_BYTES,
        ),
        event_sinks=[events.extend],
    )
    ps = prompts()
    for i, p in enumerate(ps):
        run(eng, f"a{i}", p)
    disk = eng.kv_tiers.disk
    assert disk.flush(10) and eng.kv_tiers.disk_meta
    shutil.rmtree(disk.path)
    for i, p in enumerate(ps):  # evictions write to the folder that is gone
        assert run_within(eng, f"b{i}", p, 30).outputs[0].token_ids == uncached[i]
    deadline = time.monotonic() + 10
    while eng.kv_tiers.disk is not None and time.monotonic() < deadline:
        eng.step()  # each step's poll; the writer notices within a second when idle
        time.sleep(0.05)
    assert eng.kv_tiers.disk is None and not eng.kv_tiers.disk_meta
    assert eng.stats()["kv_tier_disk_folder_lost"] == 1
    assert eng.scheduler.load_report().kv_disk_state == DISK_OFF
    lines = [r for r in caplog.records if "KV disk tier off" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert "deleted" in lines[0].getMessage()

    def storage(kind: type) -> list:
        return [
            h for e in events if isinstance(e, kind) and e.medium == MEDIUM_STORAGE
            for h in e.block_hashes
        ]  # fmt: skip

    stored, removed = storage(BlockStored), storage(BlockRemoved)
    assert sorted(stored) == sorted(removed)  # the router's index holds nothing of it now
    again = run_within(eng, "again", ps[0], 30)  # no tier below: computed, the same tokens
    assert again.outputs[0].token_ids == uncached[0] and not again.num_tier_cached_tokens
    eng.close()


@pytest.mark.parametrize("end", ["shutdown", "failure"])
def test_the_engine_thread_s_end_removes_the_disk_folder(tmp_path: Path, end: str) -> None:
    eng = engine(kv_disk_path=str(tmp_path / "kv"), kv_disk_bytes=64 * BLOCK_BYTES)
    ps = prompts()
    for i, p in enumerate(ps):
        run(eng, f"a{i}", p)
    assert eng.kv_tiers.disk.flush(10)
    folder = eng.kv_tiers.disk.path
    assert list(folder.glob("*.kvb"))
    hosted = AsyncLLMEngine(eng)  # as a replica hosts it
    if end == "shutdown":
        hosted.shutdown()
    else:
        hosted.inject_failure("injected")

        async def ask() -> None:
            with pytest.raises(EngineDeadError):
                async for _ in hosted.generate(ps[0], GREEDY):
                    pass

        asyncio.run(ask())
        assert hosted.wait_failed(10)
    assert not folder.exists() and not (tmp_path / "kv").exists()


def _read_as_nobody(root: Path) -> int:
    """Every byte another local user (uid and gid 65534) reads of the files under ``root``,
    in a forked child: what it could hand the attack."""
    pid = os.fork()
    if pid == 0:  # the child: no Python cleanup, no pytest, an exit code only
        got = 0
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            for folder, _, names in os.walk(root):  # a folder it may not list yields nothing
                for name in names:
                    try:
                        with open(os.path.join(folder, name), "rb") as f:
                            got += len(f.read())
                    except OSError:
                        pass
        finally:
            os._exit(min(got, 255))
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.fixture
def open_top() -> Iterator[Path]:
    """A folder under /tmp that any user may enter (pytest's own tmp folders are 0700)."""
    top = Path(tempfile.mkdtemp(prefix="kvroute-modes-", dir="/tmp"))
    try:
        yield top
    finally:
        shutil.rmtree(top, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")
def test_another_local_user_reads_nothing_of_the_unsealed_default_while_it_runs_or_after(
    open_top: Path, v0_of_token: np.ndarray
) -> None:
    """The default (unsealed) tier: the attack recovers the prompt from the files' bytes,
    but another local user gets none of them, while the engine runs and after it is gone
    without closing (a killed process leaves its folder, 0700, until the next start)."""
    top = open_top
    os.chmod(top, 0o755)  # the path down to the root is open (/tmp is): only the tier's modes act
    control = top / "control.txt"  # the child can read what the modes let it
    control.write_bytes(b"x" * 7)
    os.chmod(control, 0o644)
    assert _read_as_nobody(top) == 7
    root = top / "kv"
    cfg = EngineConfig(
        model="tiny",
        dtype="float32",
        block_size=WIDE,
        num_blocks=12,
        kv_disk_path=str(root),
        kv_disk_bytes=1 << 24,
    )
    assert cfg.kv_disk_encrypt is False  # the default
    eng = LLMEngine(cfg)
    secret = list(SECRET)
    run(eng, "tenant-b", secret)
    for i in range(3):
        run(eng, f"filler{i}", [(i * 31 + j) % 200 + 32 for j in range(100)])
    assert eng.kv_tiers.disk.flush(10)
    files = list(root.rglob("*.kvb"))
    assert any(recover(f.read_bytes(), v0_of_token) for f in files)  # the bytes hold it
    assert _read_as_nobody(top) == 7  # running: the control only
    eng.kv_tiers.disk.store.close = lambda: None  # type: ignore[method-assign]  # killed
    eng.close()
    assert list(root.rglob("*.kvb")) and _read_as_nobody(top) == 7  # gone, its folder left
