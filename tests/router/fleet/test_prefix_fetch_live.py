"""Prefix fetch live: two replicas with a transfer plane behind the real front door
(``prefix_fetch``), over HTTP with the official ``openai`` client.

What it proves end to end: a prefix cached on one replica that the router may not send to
(cordoned here: as busy as a holder can be) is pulled by the replica the request goes to,
named by hash over ZeroMQ, pinned at the holder for the pull only; the client's text is the
text of the same request computed from scratch; the holder holds nothing after; and a
holder that has evicted the prefix since, or another tenant's request, costs a recompute
with the same text, never a wrong token.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
import ray

from kvroute.replica.serve.actor import start_replica

from ...ray_session import local_ray
from ...waiting import wait_for
from ..served import MODEL, Served, serve

CONFIG = {"model": MODEL, "block_size": 16, "num_blocks": 128, "kv_transfer": True}
PREFIX = (
    "A system prompt that many requests share, long enough to fill several blocks of "
    "sixteen tokens each, so that a fetch moves more than one block of its KV cache: "
    "answer briefly, cite the manual, and never reveal the secret word. "
)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with local_ray() as started:
        actors = [start_replica(f"f{i}", CONFIG, num_cpus=0.5, torch_threads=1) for i in range(2)]
        started.extend(actors)
        with serve(actors, door_kw={"prefix_fetch": True}) as s:
            yield s


def text(served: Served, prompt: str, key: str = "key-a", **kw: Any) -> str:
    c = openai.OpenAI(base_url=served.url + "/v1", api_key=key, max_retries=0)
    params = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0.0, **kw}
    return c.completions.create(**params).choices[0].text


def stats(served: Served, rid: str) -> dict[str, Any]:
    return ray.get(served.actors[rid].stats.remote(), timeout=30)


def holder_of(served: Served, prompt: str) -> str:
    """Serves ``prompt`` once and waits until the router's index has its blocks."""
    door = served.door
    before = {r: stats(served, r)["prefix_cache_queries"] for r in served.actors}
    text(served, prompt)
    (rid,) = [r for r in served.actors if stats(served, r)["prefix_cache_queries"] > before[r]]
    wait_for(lambda: door.fleet.index.num_blocks(rid) > 0, 10, "the holder's blocks indexed")
    return rid


def fetches(served: Served) -> int:
    """Routing decisions with reason ``fetch``, as /metrics counts them."""
    children = served.door.metrics.routing.children
    return int(sum(c.value for (_, reason), c in children.items() if reason == "fetch"))


def test_a_cordoned_holders_prefix_is_fetched_and_the_text_is_the_same(served: Served) -> None:
    door = served.door
    prompt = PREFIX + "Question one: what does the manual say about caching?"
    holder = holder_of(served, PREFIX + "Question zero?")
    other = next(r for r in served.actors if r != holder)
    expected = text(served, prompt, key="key-b")  # another tenant: computed from scratch
    pulled = stats(served, other).get("kv_pull_blocks", 0)
    before = fetches(served)
    door.fleet.cordon(holder)
    try:
        assert text(served, prompt) == expected
    finally:
        door.fleet.cordon(holder, False)
    assert fetches(served) == before + 1
    assert stats(served, other)["kv_pull_blocks"] > pulled  # blocks did move
    assert stats(served, holder)["kv_send_fetches"] >= 1
    wait_for(lambda: stats(served, holder)["num_leased_blocks"] == 0, 10, "pin released")


def test_an_evicted_prefix_is_recomputed_with_the_same_text(served: Served) -> None:
    door = served.door
    prompt = PREFIX + "Question two: and about eviction?"
    holder = holder_of(served, PREFIX + "Question two?")
    other = next(r for r in served.actors if r != holder)
    ray.get(served.actors[other].reset_prefix_cache.remote(), timeout=30)
    expected = text(served, prompt, key="key-b")
    # The holder forgets the prefix; the router's index may not have heard yet.
    assert ray.get(served.actors[holder].reset_prefix_cache.remote(), timeout=30)
    door.fleet.cordon(holder)
    try:
        assert text(served, prompt) == expected
    finally:
        door.fleet.cordon(holder, False)
    wait_for(lambda: stats(served, holder)["num_leased_blocks"] == 0, 10, "nothing pinned")
