"""Fair share: one tenant floods at ten times its share while another sends its usual
requests; the other's TTFT p90 must stay within 2x of its figure on an idle fleet.

What holds the flood back: at the front door each tenant may hold only its share of the
in-flight budget (past it, 429 with Retry-After, which the flooder honours as a greedy but
compliant client would); on each replica the waiting queue takes tenants in turn (a small
``max_num_seqs`` makes requests wait there). Cost-model replicas: the engine, scheduler
and queue are the real ones, the step times the model's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest
import ray

from kvroute.replica.actor import start_replica

from .fleet import Served, serve

MODEL = "sim:h100-8b"
SIM = {"model": MODEL, "block_size": 16, "num_blocks": 4096, "time_scale": 4.0,
       "max_num_seqs": 6}  # fmt: skip
BUDGET, SHARE = 24, 12  # the front door's in-flight budget and each tenant's share of it
FLOODERS = 10 * SHARE
PROBES = 40
FLOOD, OTHER = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning")
    try:
        actors = [start_replica(f"f{i}", SIM, num_cpus=0) for i in range(2)]
        with serve(actors) as s:
            s.door.max_in_flight, s.door.shares.cap = BUDGET, SHARE
            yield s
    finally:
        ray.shutdown()


async def ttft(http: httpx.AsyncClient, url: str, auth: dict[str, str], body: dict) -> float:
    """Seconds to the first content chunk; raises on a refusal."""
    start = time.perf_counter()
    async with http.stream("POST", url, json={**body, "stream": True}, headers=auth) as r:
        if r.status_code != 200:
            await r.aread()
            raise PermissionError(r.headers.get("retry-after", "1"))
        first = None
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {"):  # the first token's chunk
                first = time.perf_counter() - start
    assert first is not None
    return first


def probe_body(i: int) -> dict:
    return {"model": MODEL, "prompt": [(7 * i + j) % 120_000 + 1 for j in range(256)],
            "max_tokens": 4}  # fmt: skip


async def probes(http: httpx.AsyncClient, url: str) -> list[float]:
    out = []
    for i in range(PROBES):
        out.append(await ttft(http, url, OTHER, probe_body(i)))
        await asyncio.sleep(0.1)
    return out


async def run(url: str, flood: bool) -> tuple[list[float], int, int]:
    """The other tenant's TTFTs; the flooder's completed and refused requests."""
    done, refused, stop = 0, 0, asyncio.Event()

    async def flooder(http: httpx.AsyncClient, c: int) -> None:
        nonlocal done, refused
        n = 0
        while not stop.is_set():
            body = {"model": MODEL, "prompt": [(c * 977 + n * 31 + j) % 120_000 + 1
                                               for j in range(2048)], "max_tokens": 64}  # fmt: skip
            try:
                await ttft(http, url, FLOOD, body)
                done += 1
            except PermissionError as exc:  # 429: back off as Retry-After says
                refused += 1
                await asyncio.sleep(float(str(exc)))
            n += 1

    limits = httpx.Limits(max_connections=FLOODERS + 8, max_keepalive_connections=FLOODERS + 8)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        tasks = [asyncio.create_task(flooder(http, c)) for c in range(FLOODERS if flood else 0)]
        if flood:
            await asyncio.sleep(3)  # the flood is on before the first probe
        result = await probes(http, url)
        stop.set()
        await asyncio.gather(*tasks)
    return result, done, refused


def p90(xs: list[float]) -> float:
    return sorted(xs)[int(0.9 * (len(xs) - 1))]


def test_a_flooding_tenant_leaves_another_within_2x_of_its_idle_ttft(served: Served) -> None:
    url = served.url + "/v1/completions"
    idle, _, _ = asyncio.run(run(url, flood=False))
    loaded, done, refused = asyncio.run(run(url, flood=True))
    ratio = p90(loaded) / p90(idle)
    print(
        f"\nfair share: flooder {FLOODERS} clients (10x its share of {SHARE}): {done} served, "
        f"{refused} refused with 429; other tenant TTFT p90 idle {p90(idle) * 1000:.0f} ms, "
        f"under the flood {p90(loaded) * 1000:.0f} ms ({ratio:.2f}x)"
    )
    assert refused > 0 and done > 0  # the flood was real, and served up to its share
    assert ratio <= 2.0
