"""P/D live: a prefill replica and a decode replica behind the real front door, over HTTP,
with the official ``openai`` client; the same text as a unified replica.

What it proves end to end: the front door routes a request's prefill to the prefill
replica (``kv_handoff``), streams the first token from there, then continues on the
decode replica with a Resume and a KVSource; the decode replica pulls the prompt's blocks
over the transfer plane (ZeroMQ) from the prefill replica's lease and decodes on. The
client sees one stream, identical to a unified replica's; the prefill replica holds no
lease after, whether the request ran to its end or the client went away mid-decode.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import ray

from kvroute.replica.serve.actor import start_replica

from ...ray_session import local_ray
from ...waiting import wait_for
from ..served import MODEL, Served, serve

CONFIG = {"model": MODEL, "block_size": 16, "num_blocks": 128}
PROMPTS = [
    "The disaggregated fleet computes this prompt on one replica and decodes it on another",
    "Short one",
    "A third prompt, long enough to fill several blocks of sixteen tokens each, so that a "
    "pull moves more than one block of its KV cache from the prefill side to the decode side",
]


@pytest.fixture(scope="module")
def fleets() -> Iterator[tuple[Served, Served]]:
    with local_ray() as started:
        pd = [
            start_replica("p0", {**CONFIG, "role": "prefill"}, num_cpus=0.5, torch_threads=1),
            start_replica("d0", {**CONFIG, "role": "decode"}, num_cpus=0.5, torch_threads=1),
        ]
        unified = [start_replica("u0", CONFIG, num_cpus=0.5, torch_threads=1)]
        started.extend([*pd, *unified])
        # always: every request that can split does (priced: only where it pays, which an
        # idle decode replica never makes it; tests/router/routing/test_disagg.py)
        with serve(pd, door_kw={"pd_split": "always"}) as split, serve(unified) as whole:
            yield split, whole


def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key="key-a", max_retries=0)


def completion(served: Served, prompt: str, stream: bool, **kw: Any) -> str:
    params: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 24,
                              "temperature": 0.0, **kw}  # fmt: skip
    c = client(served)
    if not stream:
        return c.completions.create(**params).choices[0].text
    return "".join(ev.choices[0].text for ev in c.completions.create(stream=True, **params))


def stats(served: Served, rid: str) -> dict[str, Any]:
    return ray.get(served.actors[rid].stats.remote(), timeout=30)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_split_text_equals_unified(fleets: tuple[Served, Served], stream: bool) -> None:
    split, whole = fleets
    pulled = stats(split, "d0").get("kv_pull_blocks", 0)
    for prompt in PROMPTS:  # fresh prompts: what d0 already holds it does not pull again
        prompt = f"{'streamed' if stream else 'whole'}: {prompt}"
        assert completion(split, prompt, stream) == completion(whole, prompt, stream)
    assert stats(split, "d0")["kv_pull_blocks"] > pulled  # blocks did move
    assert split.door.fleet.role("p0") == "prefill"
    wait_for(lambda: stats(split, "p0")["num_leased_blocks"] == 0, 10, "leases released")


def test_chat_with_stop_equals_unified(fleets: tuple[Served, Served]) -> None:
    split, whole = fleets
    messages = [{"role": "user", "content": PROMPTS[0]}]
    outs = []
    for served in (split, whole):
        r = client(served).chat.completions.create(
            model=MODEL, messages=messages, max_tokens=20, temperature=0.0, seed=3
        )
        outs.append((r.choices[0].message.content, r.choices[0].finish_reason,
                     r.usage.completion_tokens))  # fmt: skip
    assert outs[0] == outs[1]


def test_one_token_request_is_not_split(fleets: tuple[Served, Served]) -> None:
    split, whole = fleets
    handoffs = split.door.counters["handoffs"]
    assert completion(split, PROMPTS[0], False, max_tokens=1) == completion(
        whole, PROMPTS[0], False, max_tokens=1
    )
    assert split.door.counters["handoffs"] == handoffs
    completion(split, PROMPTS[0], False, max_tokens=2)
    assert split.door.counters["handoffs"] == handoffs + 1


def test_client_gone_mid_decode_frees_the_lease(fleets: tuple[Served, Served]) -> None:
    split, _ = fleets
    body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 400, "temperature": 0.0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    headers = {"Authorization": "Bearer key-a"}
    url = split.url + "/v1/completions"
    handoffs = split.door.counters["handoffs"]
    # earlier tests' leases are released first (a puller's Done arrives after its response)
    wait_for(lambda: stats(split, "p0")["num_leased_blocks"] == 0, 20, "earlier leases released")
    released = stats(split, "p0")["kv_leases_released"]
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", url, json=body, headers=headers) as r,
    ):
        assert r.status_code == 200, r.read()
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen += 1
            if seen >= 5:
                break  # the client goes away while d0 decodes
    assert seen == 5  # tokens came from the decode replica before the client left
    assert split.door.counters["handoffs"] == handoffs + 1
    wait_for(lambda: stats(split, "d0")["num_running"] == 0, 20, "the decode aborted")
    wait_for(lambda: stats(split, "p0")["num_leased_blocks"] == 0, 20, "leases released")
    assert stats(split, "p0")["kv_leases_released"] == released + 1  # by its puller, not expiry


def test_structured_output_across_the_handoff(fleets: tuple[Served, Served]) -> None:
    """The grammar's state goes on on the decode replica from the first token (Resume)."""
    split, whole = fleets
    handoffs = split.door.counters["handoffs"]
    outs = []
    for served in (split, whole):
        r = client(served).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Pick a colour: " + PROMPTS[0]}],
            max_tokens=12,
            temperature=0.0,
            extra_body={"structured_outputs": {"choice": ["red", "green", "blue sky"]}},
        )
        outs.append(r.choices[0].message.content)
    assert outs[0] == outs[1] and outs[0] in ("red", "green", "blue sky")
    assert split.door.counters["handoffs"] == handoffs + 1


def test_decode_replica_failing_mid_stream_fails_over(fleets: tuple[Served, Served]) -> None:
    """The decode replica's engine fails mid-decode (no request of it in the failing
    step): the stream goes on from the tokens it sent, on the replica left, whole."""
    split, whole = fleets
    prompt = "failover: " + PROMPTS[2]
    eos = {"extra_body": {"ignore_eos": True}}
    want = completion(whole, prompt, True, max_tokens=120, **eos)
    params: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 120,
                              "temperature": 0.0, "stream": True, **eos}  # fmt: skip
    failovers = split.door.counters["failovers"]
    got = []
    for i, ev in enumerate(client(split).completions.create(**params)):
        got.append(ev.choices[0].text)
        if i == 10:
            ray.get(split.actors["d0"].inject_engine_failure.remote(), timeout=30)
    assert "".join(got) == want
    assert split.door.counters["failovers"] == failovers + 1
