"""A replica's process killed (SIGKILL) under concurrent streams: the streams fail over.

Why a real kill: no word comes from a dead process's engine, so the front door cannot tell
whether a request caused the death. By its rule the first request to report the death is
not replayed (it could be a query of death); every other stream on that replica continues
on the survivor from the tokens it already streamed. The test counts what survives.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import ray

from kvroute.replica.serve.actor import start_replica

from ...ray_session import local_ray
from ...waiting import wait_for
from ..served import MODEL, Served, serve

CONFIG = {"model": MODEL, "block_size": 16, "num_blocks": 256}
AUTH = {"Authorization": "Bearer key-a"}
# KVROUTE_FAILOVER_STREAMS=60 for the drill BENCHMARKS.md records (16 in CI: 2 cores).
STREAMS = int(os.environ.get("KVROUTE_FAILOVER_STREAMS", "16"))
TOKENS = 400


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with local_ray() as started:
        actors = [
            start_replica(f"k{i}", CONFIG, num_cpus=0.5, torch_threads=1, max_restarts=-1)
            for i in range(2)
        ]
        started.extend(actors)
        with serve(actors) as s:
            yield s


def body(i: int) -> dict[str, Any]:
    prompt = f"stream {i % 4}: the kill drill"
    return {"model": MODEL, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0.0,
            "ignore_eos": True}  # fmt: skip


async def stream(
    client: httpx.AsyncClient, url: str, i: int, started: asyncio.Event, where: dict[int, str]
) -> tuple[str, bool]:
    """(text, ended with an error event)."""
    text, error = [], False
    async with client.stream("POST", url, json={**body(i), "stream": True}, headers=AUTH) as r:
        where[i] = r.headers["x-kvroute-replica"]
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                error = True
                continue
            text.append(event["choices"][0]["text"])
            if len(where) == STREAMS:
                started.set()
    return "".join(text), error


async def drill(served: Served) -> tuple[list[tuple[str, bool]], str]:
    url = served.url + "/v1/completions"
    started, where = asyncio.Event(), {}
    async with httpx.AsyncClient(timeout=120) as client:
        tasks = [
            asyncio.create_task(stream(client, url, i, started, where)) for i in range(STREAMS)
        ]
        await asyncio.wait_for(started.wait(), 60)
        counts = {r: list(where.values()).count(r) for r in set(where.values())}
        victim = max(counts, key=lambda r: counts[r])
        pid = ray.get(served.actors[victim].info.remote()).pid
        os.kill(pid, signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
    return results, victim


def test_streams_survive_a_replica_kill(served: Served) -> None:
    client = httpx.Client(timeout=120)
    reference = [
        client.post(served.url + "/v1/completions", json=body(i), headers=AUTH).json()["choices"][
            0
        ]["text"]
        for i in range(4)
    ]
    door = served.door
    results, victim = asyncio.run(drill(served))
    failed = [i for i, (_, error) in enumerate(results) if error]
    survived = [i for i, (text, error) in enumerate(results) if not error]
    print(f"\nstreams: {STREAMS}, failed over: {door.counters['failovers']}, "
          f"survived: {len(survived)}, failed: {len(failed)}")  # fmt: skip
    # At most the one stream that reported the death is not replayed; the rest read as if
    # nothing happened.
    assert len(failed) <= 1, failed
    assert door.counters["failovers"] >= 1
    for i in survived:
        assert results[i][0] == reference[i % 4], i
    wait_for(lambda: victim in door.fleet.alive(), 60, "the killed replica is back")
