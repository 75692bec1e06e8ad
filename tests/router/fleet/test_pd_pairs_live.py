"""P/D pairs live: two replicas of role ``both`` with a transfer plane behind the real
front door (``pd_pair``), over HTTP with the official ``openai`` client.

What it proves end to end: with every request split (``pd_split="always"``), a request's
prefill runs on one replica, which hands off after its first token, and its decode on the
other one -- never back on the replica that computed its prompt while another can take it
-- pulling the prompt's blocks over ZeroMQ. The text equals a unified replica's, and no
lease is left behind.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvroute.replica.serve.actor import start_replica

from ...ray_session import local_ray
from ...waiting import wait_for
from ..served import MODEL, Served, serve
from .test_pd_live import completion, stats

CONFIG = {"model": MODEL, "block_size": 16, "num_blocks": 128}
PROMPT = (
    "A pair of replicas of role both: this prompt's prefill runs on one of them and its "
    "decode on the other, which pulls several blocks of its KV cache over the plane"
)


@pytest.fixture(scope="module")
def fleets() -> Iterator[tuple[Served, Served]]:
    with local_ray() as started:
        pair = [
            start_replica(f"b{i}", {**CONFIG, "kv_transfer": True}, num_cpus=0.5, torch_threads=1)
            for i in range(2)
        ]
        unified = [start_replica("u0", CONFIG, num_cpus=0.5, torch_threads=1)]
        started.extend([*pair, *unified])
        kw = {"pd_split": "always", "pd_pair": True}
        with serve(pair, door_kw=kw) as split, serve(unified) as whole:
            yield split, whole


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_pair_splits_between_two_replicas_with_the_same_text(
    fleets: tuple[Served, Served], stream: bool
) -> None:
    split, whole = fleets
    door = split.door
    pulled = {r: stats(split, r).get("kv_pull_blocks", 0) for r in split.actors}
    handoffs = door.counters["handoffs"]
    prompt = f"{'streamed' if stream else 'whole'}: {PROMPT}"
    assert completion(split, prompt, stream) == completion(whole, prompt, stream)
    assert door.counters["handoffs"] == handoffs + 1
    moved = {r: stats(split, r)["kv_pull_blocks"] - pulled[r] for r in split.actors}
    assert sorted(moved.values())[0] == 0 and sorted(moved.values())[1] > 0  # one pulled
    for rid in split.actors:
        wait_for(lambda r=rid: stats(split, r)["num_leased_blocks"] == 0, 10, "leases released")
