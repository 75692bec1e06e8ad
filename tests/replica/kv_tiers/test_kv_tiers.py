"""The engine's lower KV tiers (issue 38): a prompt evicted from a small device pool and
asked again is loaded back from host memory or disk, not recomputed, and its output is the
uncached run's (and transformers'); a damaged disk file costs a recompute, never a wrong
answer or a failed request."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvroute.replica import EngineConfig, LLMEngine, SamplingParams
from kvroute.replica.engine.llm_engine import EngineOutput
from kvroute.replica.model.models import tiny_model_path

from ..hf_reference import hf_greedy

BLOCK = 4
NUM_BLOCKS = 24  # 96 slots: two of the conversations below, not four
PROMPT = 40  # 10 blocks; a hit stops one token short: 9 blocks, 36 tokens
HIT = (PROMPT - 1) // BLOCK * BLOCK
NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW)
BLOCK_BYTES = 16384  # tiny in fp32: 4 KiB of K and V per token


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1, 250) for _ in range(PROMPT)] for _ in range(4)]


def run(engine: LLMEngine, rid: str, prompt: list[int]) -> EngineOutput:
    engine.add_request(rid, prompt, GREEDY)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                final = out
    assert final is not None
    return final


def engine(**tiers: object) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model="tiny", dtype="float32", block_size=BLOCK, num_blocks=NUM_BLOCKS, **tiers
        )  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def uncached() -> list[list[int]]:
    """Each prompt's greedy output from an engine with room for all (no eviction)."""
    ref = LLMEngine(EngineConfig(model="tiny", dtype="float32", block_size=BLOCK, num_blocks=256))
    return [run(ref, f"u{i}", p).outputs[0].token_ids for i, p in enumerate(prompts())]


def tier_configs(tmp: Path) -> dict[str, tuple[dict[str, object], set[str]]]:
    return {
        "host": ({"kv_host_bytes": 64 * BLOCK_BYTES}, {"CPU"}),
        "disk": ({"kv_disk_path": str(tmp / "kv"), "kv_disk_bytes": 64 * BLOCK_BYTES}, {"STORAGE"}),
        # a host tier of 16 blocks: the first prompt's tail, evicted first, spills on to
        # the disk; its head is still in the host
        "host+disk": (
            {
                "kv_host_bytes": 16 * BLOCK_BYTES,
                "kv_disk_path": str(tmp / "kv"),
                "kv_disk_bytes": 64 * BLOCK_BYTES,
            },
            {"CPU", "STORAGE"},
        ),
    }


@pytest.mark.parametrize("tiers", ["host", "disk", "host+disk"])
def test_an_evicted_prompt_loads_from_a_lower_tier_with_the_uncached_output(
    tiers: str, uncached: list[list[int]], tmp_path: Path
) -> None:
    config, media = tier_configs(tmp_path)[tiers]
    eng = engine(**config)
    ps = prompts()
    for i, p in enumerate(ps):
        assert run(eng, f"a{i}", p).outputs[0].token_ids == uncached[i]
    again = run(eng, "again", ps[0])
    assert again.outputs[0].token_ids == uncached[0]
    # all of it came from below the device (the device pool evicted it), by tier
    assert again.num_cached_tokens == HIT
    assert set(again.num_tier_cached_tokens) == media
    assert sum(again.num_tier_cached_tokens.values()) == HIT
    stats = eng.stats()
    assert stats["kv_tier_loaded"] == HIT // BLOCK and stats["kv_tier_load_failures"] == 0


def test_a_load_matches_transformers(tmp_path: Path) -> None:
    """The reference that does not share the engine's kernels: transformers' generate."""
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_path(), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    eng = engine(kv_host_bytes=64 * BLOCK_BYTES)
    ps = prompts()
    for i, p in enumerate(ps):
        run(eng, f"a{i}", p)
    again = run(eng, "again", ps[1])
    assert again.num_tier_cached_tokens == {"CPU": HIT}
    assert again.outputs[0].token_ids == hf_greedy(model, ps[1], NEW)


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_a_damaged_disk_file_costs_a_recompute_and_nothing_else(
    damage: str, uncached: list[list[int]], tmp_path: Path
) -> None:
    folder = tmp_path / "kv"
    eng = engine(kv_disk_path=str(folder), kv_disk_bytes=64 * BLOCK_BYTES)
    ps = prompts()
    for i, p in enumerate(ps):
        run(eng, f"a{i}", p)
    hashes = eng.hasher.hash_blocks(ps[0])
    assert eng.kv_tiers.disk.flush(10)  # the writer thread has put the files in place
    victim = eng.kv_tiers.disk.file_of(hashes[3])  # the 4th block: 3 load, the rest recompute
    assert victim.exists()
    # under a running engine: another request is part-way when the file is damaged
    eng.add_request("busy", ps[2], GREEDY)
    eng.step()
    raw = victim.read_bytes()
    if damage == "truncate":
        victim.write_bytes(raw[: len(raw) // 2])
    elif damage == "flip":
        flipped = bytearray(raw)
        flipped[len(raw) - 100] ^= 0x10
        victim.write_bytes(bytes(flipped))
    else:
        victim.unlink()
    again = run(eng, "again", ps[0])
    assert again.outputs[0].token_ids == uncached[0]
    assert again.outputs[0].finish_reason == "length"
    assert again.num_tier_cached_tokens == {"STORAGE": 3 * BLOCK}
    assert again.num_cached_tokens == 3 * BLOCK
    stats = eng.stats()
    assert stats["kv_tier_load_failures"] == 1
    assert hashes[3] not in eng.kv_tiers.disk  # dropped from its tier (and its event sent)
    # the engine goes on serving, the damaged prefix now computed and cached afresh
    assert run(eng, "next", ps[3]).outputs[0].token_ids == uncached[3]
    assert run(eng, "then", ps[0]).outputs[0].token_ids == uncached[0]


def test_a_host_copy_changed_after_its_checksum_costs_a_recompute(
    uncached: list[list[int]],
) -> None:
    """The checksum of a host copy is computed off the step (by the loader thread); a byte
    of the copy flipped after that is caught at load: the blocks before it load, the rest
    is recomputed, the output is the uncached one."""
    eng = engine(kv_host_bytes=64 * BLOCK_BYTES)
    ps = prompts()
    for i, p in enumerate(ps):
        run(eng, f"a{i}", p)
    hashes = eng.hasher.hash_blocks(ps[0])
    entry = eng.kv_tiers.host[hashes[2]]
    deadline = time.monotonic() + 10
    while entry.digest is None and time.monotonic() < deadline:
        time.sleep(0.01)  # sealed by the loader thread, not by this one
    assert entry.digest is not None
    entry.data[100] ^= 0x01
    again = run(eng, "again", ps[0])
    assert again.outputs[0].token_ids == uncached[0]
    assert again.num_tier_cached_tokens == {"CPU": 2 * BLOCK}
    assert eng.stats()["kv_tier_load_failures"] == 1
    assert hashes[2] not in eng.kv_tiers.host


def test_a_request_that_computes_every_token_loads_nothing(tmp_path: Path) -> None:
    eng = engine(kv_host_bytes=64 * BLOCK_BYTES)
    ps = prompts()
    for i, p in enumerate(ps):
        run(eng, f"a{i}", p)
    eng.add_request("lp", ps[0], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1))
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert outs[-1].num_cached_tokens == 0 and not outs[-1].num_tier_cached_tokens
    assert eng.stats()["kv_tier_loaded"] == 0


def test_tiers_need_a_model_and_prefix_caching(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cost model"):
        LLMEngine(EngineConfig(model="sim:h100-8b", kv_host_bytes=1 << 20))
    with pytest.raises(ValueError, match="prefix caching"):
        LLMEngine(EngineConfig(model="tiny", kv_host_bytes=1 << 20, enable_prefix_caching=False))
    with pytest.raises(ValueError, match="go together"):
        LLMEngine(EngineConfig(model="tiny", kv_disk_path=str(tmp_path)))


def test_coefficients_report_the_measured_tiers(tmp_path: Path) -> None:
    eng = engine(kv_host_bytes=8 * BLOCK_BYTES, kv_disk_path=str(tmp_path), kv_disk_bytes=1 << 20)
    coef = eng.cost_coefficients()
    assert coef.kv_bytes_per_token == BLOCK_BYTES // BLOCK
    assert set(coef.tier_bytes_per_s) == {"CPU", "STORAGE"}
    assert all(bw > 0 for bw in coef.tier_bytes_per_s.values())
    plain = engine()
    assert plain.kv_tiers is None and plain.kv_cache_manager.block_pool.tiers is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_host_load_on_cuda_runs_on_the_side_stream_and_matches() -> None:
    """On a GPU the loads go device-ward on a side stream with pinned copies."""
    eng = LLMEngine(
        EngineConfig(
            model="tiny",
            block_size=BLOCK,
            num_blocks=NUM_BLOCKS,
            device="cuda",
            dtype="float32",
            kv_host_bytes=64 * BLOCK_BYTES,
        )
    )
    assert eng.kv_tiers._stream is not None
    ps = prompts()
    for i, p in enumerate(ps):
        run(eng, f"a{i}", p)
    again = run(eng, "again", ps[0])
    assert again.num_tier_cached_tokens == {"CPU": HIT}
    ref = LLMEngine(
        EngineConfig(model="tiny", block_size=BLOCK, num_blocks=256, device="cuda", dtype="float32")
    )
    assert again.outputs[0].token_ids == run(ref, "ref", ps[0]).outputs[0].token_ids


def stall(eng: LLMEngine, block_hash: bytes, *, miss: bool = False) -> Callable[[], None]:
    """Holds the disk read of ``block_hash``'s file until the function returned is called
    (a slow disk: the engines here read with a deadline longer than the hold); released,
    the read gives the file's bytes, or a miss with ``miss``."""
    assert eng.kv_tiers.disk.flush(10)  # the writer thread has put the file in place
    store = eng.kv_tiers.disk.store
    gate = threading.Event()
    real = store.read_file

    def slow(h: bytes, size: int, body: memoryview, reading=None) -> bytes | None:
        if h == block_hash:
            assert gate.wait(60)  # a bound: a test that never releases fails, not hangs
            if miss:
                return None
        return real(h, size, body, reading)

    store.read_file = slow  # type: ignore[method-assign]
    return gate.set


SLOW_DISK = {"kv_disk_bytes": 64 * BLOCK_BYTES, "kv_disk_read_timeout_s": 60.0}


def test_a_request_aborted_while_its_blocks_load_releases_them(
    uncached: list[list[int]], tmp_path: Path
) -> None:
    eng = engine(kv_disk_path=str(tmp_path / "kv"), **SLOW_DISK)
    ps = prompts()
    for i, p in enumerate(ps):
        run(eng, f"a{i}", p)
    release = stall(eng, eng.hasher.hash_blocks(ps[0])[0])
    eng.add_request("gone", ps[0], GREEDY)
    eng.step()  # its load starts and does not land: the request waits out of the queue
    assert "gone" in eng.scheduler.loading
    outs = eng.abort_requests(["gone"])
    assert outs[0].finished and outs[0].outputs[0].finish_reason == "abort"
    release()
    while eng.has_unfinished_requests():
        eng.step()
    pool = eng.kv_cache_manager.block_pool
    pool.check_invariants()
    assert pool.get_num_free_blocks() == NUM_BLOCKS  # nothing held by the landed load
    # what it loaded is cached: the next ask hits it on the device, same output
    again = run(eng, "again", ps[0])
    assert again.outputs[0].token_ids == uncached[0]
    assert again.num_cached_tokens == HIT and not again.num_tier_cached_tokens


def test_a_slow_load_holds_up_neither_the_step_nor_the_other_requests(
    uncached: list[list[int]], tmp_path: Path
) -> None:
    """The first block's read is held (a disk that is slow to answer). Meanwhile the step
    loop runs another request to its end; only then does the read answer, with a miss:
    the load fails, and the waiting request recomputes, with the uncached output."""
    eng = engine(kv_disk_path=str(tmp_path / "kv"), **SLOW_DISK)
    ps = prompts()
    for i, p in enumerate(ps):
        run(eng, f"a{i}", p)
    release = stall(eng, eng.hasher.hash_blocks(ps[0])[0], miss=True)
    eng.add_request("slow", ps[0], GREEDY)
    eng.step()
    assert "slow" in eng.scheduler.loading  # its load is under way, it is out of the queue
    eng.add_request("other", ps[3], GREEDY)  # runs while "slow" still waits for its blocks
    other = None
    while other is None:
        other = next((o for o in eng.step() if o.request_id == "other" and o.finished), None)
    assert "slow" in eng.scheduler.loading
    release()
    final = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.request_id == "slow" and out.finished:
                final = out
    assert other.outputs[0].token_ids == uncached[3]
    assert final is not None and final.outputs[0].token_ids == uncached[0]
    assert final.num_tier_cached_tokens == {} and eng.stats()["kv_tier_load_failures"] == 1


def test_concurrent_conversations_all_finish_with_the_uncached_outputs() -> None:
    """Four requests at a time over a pool that holds few of them, multi-turn prompts that
    return to earlier conversations: loads hold device blocks while other requests need
    them. Every request must end (none dropped while the pool is held by loads), each with
    the output of an engine that never evicts."""
    rng = random.Random(3)
    convs = [[rng.randrange(1, 250) for _ in range(rng.randrange(12, 60))] for _ in range(8)]
    asks: list[tuple[list[int], int]] = []
    for _ in range(40):
        c = rng.randrange(len(convs))
        convs[c] = (convs[c] + [rng.randrange(1, 250) for _ in range(rng.randrange(2, 20))])[-70:]
        asks.append((list(convs[c]), rng.randrange(1, 10)))

    def serve(eng: LLMEngine) -> dict[str, list[int]]:
        done: dict[str, list[int]] = {}
        queue = list(enumerate(asks))
        live = 0
        for _ in range(20_000):  # a bound: a request that never ends fails the test
            while queue and live < 4:
                i, (prompt, n) = queue.pop(0)
                params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                eng.add_request(f"q{i}", prompt, params)
                live += 1
            for out in eng.step():
                if out.finished:
                    assert out.outputs[0].finish_reason == "length", out.outputs[0].error
                    done[out.request_id] = out.outputs[0].token_ids
                    live -= 1
            if not queue and not live:
                break
        return done

    tiered = engine(kv_host_bytes=256 * BLOCK_BYTES)
    tiered.kv_cache_manager.block_pool.check_invariants()
    got = serve(tiered)
    ref = serve(
        LLMEngine(EngineConfig(model="tiny", dtype="float32", block_size=BLOCK, num_blocks=1024))
    )
    assert len(got) == len(asks) and got == ref
    assert tiered.stats()["kv_tier_loaded"] > 0
    tiered.kv_cache_manager.block_pool.check_invariants()
