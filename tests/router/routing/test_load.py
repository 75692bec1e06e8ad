"""Load: 500 streaming clients at once against a front door that admits fewer.

Every request must either complete or be refused with 429 and ``Retry-After`` -- never a
5xx, a cut stream or a hang -- and afterwards nothing may be left behind: no request in
flight at the front door, none running or waiting on a replica, every KV block free, the
front door's memory back near where it was. Cost-model replicas keep the CPU for the front
door and the clients; their engines, caches and events are the real ones.
"""

from __future__ import annotations

import asyncio
import json
import resource
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
import ray

from kvroute.router.fleet.admission import AdmissionQueue

from ...waiting import wait_for
from ..served import Served, serve_sim

CLIENTS = 500
MAX_IN_FLIGHT = 150  # fewer than the clients: a burst waits in the queue or gets a 429
QUEUE = 250  # so at least 100 of the 500 find the queue full
MODEL = "sim:h100-8b"
SIM = {"model": MODEL, "block_size": 16, "num_blocks": 2048, "time_scale": 2.0}
AUTH = {"Authorization": "Bearer key-a"}


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serve_sim("l", 2, SIM) as s:
        s.door.admission.max_in_flight = MAX_IN_FLIGHT
        s.door.admission.queue = AdmissionQueue(QUEUE, timeout_s=30.0)
        yield s


async def one(http: httpx.AsyncClient, url: str, i: int) -> str:
    tokens = [(31 * (i % 10) + j) % 120_000 + 1 for j in range(48)] + [i + 1, i + 2, i + 3]
    body = {"model": MODEL, "prompt": tokens, "max_tokens": 8, "stream": True}
    async with http.stream("POST", url, json=body, headers=AUTH) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode()
            retry = r.headers.get("retry-after")
            code = json.loads(text)["error"]["code"]
            return f"{r.status_code}:{code}:retry-after={retry}"
        lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    if lines[-1] != "data: [DONE]" or any('"error"' in x for x in lines):
        return "cut"
    return "ok"


async def burst(url: str) -> Counter[str]:
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        results = await asyncio.gather(*(one(http, url, i) for i in range(CLIENTS)))
    return Counter(results)


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        kb = next(int(x.split()[1]) for x in f if x.startswith("VmRSS:"))
    return kb / 1024


def test_500_streams_complete_or_get_429_and_nothing_is_left_behind(served: Served) -> None:
    door, url = served.door, served.url + "/v1/completions"
    asyncio.run(burst(url))  # warm: connections, tokenizer and caches
    before = rss_mb()
    outcomes = asyncio.run(burst(url))
    after = rss_mb()
    refused = {k: v for k, v in outcomes.items() if k.startswith("429")}
    print(
        f"\nload: {CLIENTS} concurrent streams, max in flight {MAX_IN_FLIGHT}, queue {QUEUE}: "
        f"{outcomes['ok']} completed, 429 {sum(refused.values())}, other "
        f"{ {k: v for k, v in outcomes.items() if k != 'ok' and not k.startswith('429')} }; "
        f"front-door process RSS {before:.0f} -> {after:.0f} MB (peak "
        f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB)"
    )
    assert outcomes["ok"] + sum(refused.values()) == CLIENTS, outcomes
    assert all(":rate_limit_exceeded:retry-after=" in k and not k.endswith("None")
               for k in refused), refused  # fmt: skip
    # The queue absorbs what the budget cannot take at once (how many arrive at once
    # depends on the machine: all 500 completed on one run, 93 were refused on another).
    assert outcomes["ok"] >= min(CLIENTS, MAX_IN_FLIGHT + QUEUE)
    assert door.admission.waiting == 0 and door.admission.queue.reserved == 0
    assert after - before < 150, (before, after)  # a second burst leaves no growth behind

    # Nothing left behind: no flight at the front door, none on a replica, every block free.
    wait_for(lambda: door.fleet.load.in_flight() == 0, 10, "the front door's flights ended")
    assert door.admission.tenant_in_flight("alpha") == 0

    def drained() -> bool:
        reports = ray.get([a.load.remote() for a in served.actors.values()], timeout=30)
        return all(
            r.num_running == 0 and r.num_waiting == 0 and r.free_blocks == r.total_blocks
            for r in reports
        )

    wait_for(drained, 10, "every replica idle with all its KV blocks free")
