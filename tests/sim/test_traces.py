"""Mooncake trace loading and the infinite-cache ceiling its README states."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvroute.sim.bounds import ceiling_hit_rate
from kvroute.sim.report import router_hashes
from kvroute.sim.simulator import SimConfig
from kvroute.sim.traces import (
    TraceRequest,
    block_tokens,
    iter_arrivals,
    load_mooncake,
    prompt_tokens,
    specs_from_trace,
)
from kvroute.sim.workloads import TokenSource

TRACES = Path(__file__).resolve().parents[2] / "traces"
needs_traces = pytest.mark.skipif(not TRACES.is_dir(), reason="shared/traces not present")


@needs_traces
@pytest.mark.parametrize(
    "name,count,ceiling",
    [
        ("mooncake_conversation_trace.jsonl", 12_031, 0.374),
        ("mooncake_synthetic_trace.jsonl", 3_993, 0.651),
    ],
)
def test_traces_load_and_match_their_readme_ceiling(name, count, ceiling):
    reqs = load_mooncake(TRACES / name)
    assert len(reqs) == count
    specs = specs_from_trace(reqs)
    hashes = router_hashes(specs, SimConfig(block_size=512), TokenSource())
    # block-granular, as the engine hits: the README's figure less the partial last blocks
    assert ceiling - 0.0015 <= ceiling_hit_rate(specs, hashes, 512) <= ceiling


def test_ceiling_counts_leading_seen_blocks_capped_at_len_minus_one():
    a = TraceRequest(0.0, 1024, 1, (1, 2))
    b = TraceRequest(1.0, 1100, 1, (1, 2, 3))  # both of a's blocks: 1024 tokens hit
    c = TraceRequest(2.0, 1024, 1, (1, 2))  # fully seen, but 1023 tokens at most: 1 block
    d = TraceRequest(3.0, 600, 1, (9, 2))  # a different first block: nothing
    specs = specs_from_trace([a, b, c, d])
    hashes = router_hashes(specs, SimConfig(block_size=512), TokenSource())
    got = ceiling_hit_rate(specs, hashes, 512)
    assert got == pytest.approx((1024 + 512) / (1024 + 1100 + 1024 + 600))


def test_block_tokens_are_fixed_and_prompts_share_real_prefixes():
    assert block_tokens(7, 1000) == block_tokens(7, 1000)
    assert block_tokens(7, 1000) != block_tokens(8, 1000)
    assert all(0 <= t < 1000 for t in block_tokens(7, 1000))
    a = prompt_tokens(TraceRequest(0, 700, 1, (5, 6)), 1000)
    b = prompt_tokens(TraceRequest(0, 1030, 1, (5, 6, 9)), 1000)
    assert len(a) == 700 and len(b) == 1030 and a == b[:700]


def test_malformed_lines_name_their_line(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
        '{"timestamp": 5, "input_length": 2000, "output_length": 1, "hash_ids": [1]}\n'
    )
    with pytest.raises(ValueError, match=":2:"):
        load_mooncake(p)
    p.write_text("not json\n")
    with pytest.raises(ValueError, match=":1:"):
        load_mooncake(p)


def test_arrivals_are_sorted_and_scaled():
    reqs = [TraceRequest(2.0, 1, 1, (1,)), TraceRequest(1.0, 1, 1, (2,))]
    assert [t for t, _ in iter_arrivals(reqs, speed=2.0)] == [0.5, 1.0]
    with pytest.raises(ValueError):
        list(iter_arrivals(reqs, speed=0))
