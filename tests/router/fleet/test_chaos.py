"""Chaos: streaming clients without pause while a replica's process is killed every 10 s.

Why cost-model replicas: the engine, its KV cache, its events and Ray's restarts are the
real ones, but no weights load, so a killed replica is back in seconds and the CPU is left
to the front door and the clients. What is counted: requests completed (with how many
continued on another replica mid-stream), failed (an error status or event) and hung
(no answer within the client's timeout). Afterwards the router's index of every replica
must equal that replica's cache.

CI runs 30 s (two kills); ``KVROUTE_CHAOS_SECONDS=120`` runs the full drill:

    KVROUTE_CHAOS_SECONDS=120 python -m pytest -s tests/router/fleet/test_chaos.py
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
import ray

from ...waiting import wait_for
from ..served import Served, serve_sim

SECONDS = float(os.environ.get("KVROUTE_CHAOS_SECONDS", "30"))
KILL_EVERY_S = 10.0
CLIENTS = 50
REPLICAS = 3
MODEL = "sim:h100-8b"
# time_scale 4: every modelled step takes 4x its H100 time, so 2 cores keep up.
SIM = {"model": MODEL, "block_size": 16, "num_blocks": 1024, "time_scale": 4.0}
AUTH = {"Authorization": "Bearer key-a"}
TIMEOUT_S = 30.0  # a request with no answer by then is hung


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serve_sim("c", REPLICAS, SIM, max_restarts=-1) as s:
        yield s


def prompt(client: int, n: int) -> list[int]:
    """Eight shared system prompts of 4 blocks, then the client's own turn: caches fill,
    hits happen and events flow while replicas die."""
    system = [(97 * (client % 8) + 13 * i) % 120_000 + 1 for i in range(64)]
    return system + [(client * 1000 + n * 7 + i) % 120_000 + 1 for i in range(20)]


async def one(client: httpx.AsyncClient, url: str, c: int, n: int) -> str:
    """The outcome of one streamed request: ok, failed:<why>, or hung."""
    body = {"model": MODEL, "prompt": prompt(c, n), "max_tokens": 8, "stream": True}
    try:
        async with asyncio.timeout(TIMEOUT_S):
            async with client.stream("POST", url, json=body, headers=AUTH) as r:
                if r.status_code != 200:
                    await r.aread()
                    return f"failed:{r.status_code}"
                finish, done = None, False
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        event = json.loads(line.removeprefix("data: "))
                        if "error" in event:
                            return f"failed:{event['error'].get('code')}"
                        finish = event["choices"][0].get("finish_reason") or finish
                return "ok" if done and finish == "length" else "failed:cut"
    except TimeoutError:
        return "hung"
    except httpx.TransportError as exc:  # the connection broke: counted, never hidden
        return f"failed:{type(exc).__name__}"


async def drill(served: Served) -> tuple[Counter[str], int]:
    url = served.url + "/v1/completions"
    end = time.monotonic() + SECONDS
    outcomes: Counter[str] = Counter()
    kills = 0

    async def client_loop(http: httpx.AsyncClient, c: int) -> None:
        n = 0
        while time.monotonic() < end:
            outcomes[await one(http, url, c, n)] += 1
            n += 1

    async def killer() -> None:
        nonlocal kills
        ids = sorted(served.actors)
        while True:
            await asyncio.sleep(KILL_EVERY_S)
            if time.monotonic() >= end - 1:
                return
            alive = [r for r in ids if r in served.door.fleet.alive()] or ids
            victim = alive[kills % len(alive)]
            pid = (await served.actors[victim].info.remote()).pid
            os.kill(pid, signal.SIGKILL)
            kills += 1

    limits = httpx.Limits(max_connections=CLIENTS + 8, max_keepalive_connections=CLIENTS + 8)
    async with httpx.AsyncClient(timeout=TIMEOUT_S + 5, limits=limits) as http:
        await asyncio.gather(killer(), *(client_loop(http, c) for c in range(CLIENTS)))
    return outcomes, kills


def test_streams_under_a_replica_kill_every_10_s(served: Served) -> None:
    door = served.door
    failovers0, retries0 = door.counters["failovers"], door.counters["retries"]
    outcomes, kills = asyncio.run(drill(served))
    total = sum(outcomes.values())
    ok = outcomes["ok"]
    failed = {k: v for k, v in outcomes.items() if k.startswith("failed")}
    print(
        f"\nchaos {SECONDS:.0f} s, {CLIENTS} clients, {kills} kills: {total} requests, "
        f"{ok} completed ({ok / total:.2%}), "
        f"{door.counters['failovers'] - failovers0} continued on another replica mid-stream, "
        f"{door.counters['retries'] - retries0} retried before their first token, "
        f"failed {sum(failed.values())} {failed}, hung {outcomes['hung']}"
    )
    assert kills >= max(1, int(SECONDS // KILL_EVERY_S) - 1)
    assert outcomes["hung"] == 0
    assert ok / total >= 0.99, outcomes

    # Every replica is back, and the router's index of each equals its cache.
    wait_for(lambda: len(door.fleet.alive()) == REPLICAS, 60, "every killed replica is back")

    def converged() -> bool:
        truth = ray.get([a.cached_blocks.remote() for a in served.actors.values()], timeout=30)
        return all(
            door.fleet.index.counts(rid) == cached
            for rid, cached in zip(served.actors, truth, strict=True)
        )

    wait_for(converged, 30, "the router's index equals every replica's cache")
    # Not vacuous: the index holds blocks. (The replica killed last may come back after the
    # drill's traffic ended, on a loaded host, and then rightly holds none.)
    assert any(door.fleet.index.num_blocks(rid) > 0 for rid in served.actors)
