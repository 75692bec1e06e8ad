"""Flow control and priorities, live: the real front door under uvicorn over cost-model
replicas, driven with the official ``openai`` client (and raw httpx to hang up).

To make the order of dispatch deterministic, a test may hold a replica's room itself (an
occupied slot, put on the server's loop), queue requests behind it, then let go: what the
queue does next is the real queue's, over real sends, first tokens and slots.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from kvroute.replica.serve.actor import start_replica
from kvroute.router.fleet.flow import FlowControl
from kvroute.router.fleet.tenants import PRIORITY_MIN

from ...ray_session import local_ray
from ...waiting import wait_for
from ..served import Served, assert_clean_error, serve

CONFIG = {"model": "sim:h100-8b", "block_size": 16, "num_blocks": 2048, "time_scale": 1.0}
VOCAB = 120_000
A, B = "key-a", "key-b"  # tenants alpha and beta (tests/router/served.py)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with local_ray() as started:
        actors = [start_replica(f"fl{i}", CONFIG, num_cpus=0) for i in range(2)]
        started.extend(actors)
        door_kw = {"flow_depth": 1, "flow_max_waiting": 4}
        with serve(actors, door_kw=door_kw, priority_header="x-priority") as s:
            yield s


def flow_of(s: Served) -> FlowControl:
    assert s.door.flow is not None
    return s.door.flow


def on_loop(s: Served, fn: Callable[[], Any]) -> Any:
    """``fn()`` on the server's event loop (the queue is the loop's alone)."""
    task = s.door.fleet._monitor
    assert task is not None
    done: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def call() -> None:
        try:
            done.set_result(fn())
        except BaseException as exc:
            done.set_exception(exc)

    task.get_loop().call_soon_threadsafe(call)
    return done.result(10)


HOLD = 2  # slots of the most urgent work that leave room for nobody (twice the depth)


def hold(s: Served) -> None:
    """Every replica busy: slots of this front door's taken on each."""
    flow = flow_of(s)
    for rid in s.actors:
        for _ in range(HOLD):
            on_loop(s, lambda r=rid: flow.occupy(r, 0, PRIORITY_MIN, "hold"))


def release(s: Served, replicas: list[str] | None = None) -> None:
    flow = flow_of(s)
    for rid in s.actors if replicas is None else replicas:
        for _ in range(HOLD):
            on_loop(s, lambda r=rid: flow.vacate(r, 0, PRIORITY_MIN, "hold"))


def forget_estimates(s: Served) -> None:
    """No estimate of the engine's time per position nor of the drain rate: a held slot's
    seconds, given back, count as engine time, and a test that released one within the
    window would have the next request shed at once on that estimate."""
    flow = flow_of(s)
    on_loop(s, lambda: (flow._slot_samples.clear(), flow._dispatch_times.clear()))


def record_dispatches(s: Served) -> list[tuple[int, str]]:
    """(band, tenant) of each request the queue sends from now on, in order."""
    flow = flow_of(s)
    sent: list[tuple[int, str]] = []
    inner = flow._dispatched

    def dispatched(w: Any, now: float) -> None:
        sent.append((w.band, w.tenant))
        inner(w, now)

    on_loop(s, lambda: setattr(flow, "_dispatched", dispatched))
    return sent


def settled(s: Served) -> None:
    """Nothing waits, nothing holds a slot, every ticket is back."""
    flow = flow_of(s)
    wait_for(
        lambda: flow.waiting == 0 and not flow.unstarted and s.door.admission.in_flight == 0,
        20,
        "the queue drained, every slot and ticket back",
    )


def client(s: Served, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0, timeout=60)


def prompt(i: int, n: int = 64) -> list[int]:
    return [(i * 977 + j) % VOCAB + 1 for j in range(n)]


async def first_token_at(c: openai.AsyncOpenAI, i: int, **kw: Any) -> float:
    """When the request's first chunk arrived (perf_counter); reads the stream to its end."""
    stream = await c.completions.create(
        model="sim:h100-8b", prompt=prompt(i), max_tokens=4, stream=True, **kw
    )
    first = None
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text is not None:
            first = time.perf_counter()
    assert first is not None
    return first


async def queue_then_release(s: Served, calls: list[Callable[[], Any]]) -> list[float]:
    """Holds the replicas, starts ``calls`` one at a time (each queued before the next
    starts), lets one replica go (so they are sent one by one, each when the one before
    has its first token), and returns what each returned."""
    flow = flow_of(s)
    hold(s)
    first, *rest = list(s.actors)
    tasks = []
    try:
        for n, call in enumerate(calls, 1):
            tasks.append(asyncio.ensure_future(call()))
            await _until(lambda n=n: flow.waiting == n)
    finally:
        release(s, [first])
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        release(s, rest)


def test_the_most_urgent_band_goes_first(served: Served) -> None:
    async def main() -> list[float]:
        c = client(served, A)
        calls = [
            lambda: first_token_at(c, 1, extra_body={"priority": 5}),
            lambda: first_token_at(c, 2, extra_body={"priority": 5}),
            lambda: first_token_at(c, 3, extra_headers={"x-priority": "-2"}),
            lambda: first_token_at(c, 4),  # the tenant's default: 0
        ]
        return await queue_then_release(served, calls)

    sent = record_dispatches(served)
    batch1, batch2, urgent, normal = asyncio.run(main())
    assert [band for band, _ in sent] == [-2, 0, 5, 5]
    assert urgent < batch1 < batch2 and normal < batch2
    settled(served)
    flow = flow_of(served)
    assert {-2, 0, 5} <= set(flow.stats.dispatched)


def test_within_a_band_the_least_served_tenant_goes_first(served: Served) -> None:
    async def main() -> list[float]:
        a, b = client(served, A), client(served, B)
        calls = [
            lambda: first_token_at(a, 11),
            lambda: first_token_at(a, 12),
            lambda: first_token_at(a, 13),
            lambda: first_token_at(b, 14),  # came last, served second
        ]
        return await queue_then_release(served, calls)

    sent = record_dispatches(served)
    a1, a2, a3, b1 = asyncio.run(main())
    assert [tenant for _, tenant in sent] == ["alpha", "beta", "alpha", "alpha"]
    assert a1 < a2 < a3 and b1 < a3
    settled(served)


def test_bad_priorities_are_400(served: Served) -> None:
    url = served.url + "/v1/completions"
    auth = {"Authorization": f"Bearer {A}"}
    body = {"model": "sim:h100-8b", "prompt": prompt(20), "max_tokens": 2}
    for extra, headers, param in (
        ({"priority": "high"}, {}, "priority"),
        ({"priority": 1.5}, {}, "priority"),
        ({"priority": 2**40}, {}, "priority"),
        ({}, {"x-priority": "urgent"}, "x-priority"),
        ({}, {"x-kvroute-slo-ttft-ms": "soon"}, "x-kvroute-slo-ttft-ms"),
        ({}, {"x-llm-d-slo-ttft-ms": "-5"}, "x-llm-d-slo-ttft-ms"),
    ):
        r = httpx.post(url, json={**body, **extra}, headers={**auth, **headers}, timeout=30)
        err = assert_clean_error(r, 400)
        assert err["param"] == param, err
    c = openai.OpenAI(base_url=served.url + "/v1", api_key=A, max_retries=0)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(
            model="sim:h100-8b",
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"priority": "first"},
        )
    settled(served)


def test_a_full_band_is_429_with_retry_after_and_the_queued_still_run(served: Served) -> None:
    async def main() -> None:
        c = client(served, A)
        flow = flow_of(served)
        hold(served)
        try:
            queued = []
            for i in range(4):  # the band's bound
                queued.append(asyncio.ensure_future(first_token_at(c, 30 + i)))
                await _until(lambda n=i + 1: flow.waiting == n)
            with pytest.raises(openai.RateLimitError) as info:
                await c.completions.create(model="sim:h100-8b", prompt=prompt(39), max_tokens=2)
            r = info.value.response
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["code"] == "flow_queue_full"
            # another band has its own bound
            other = asyncio.ensure_future(first_token_at(c, 38, extra_body={"priority": 1}))
            await _until(lambda: flow.waiting == 5)
        finally:
            release(served)
        await asyncio.gather(*queued, other)
        assert flow.stats.shed.get((0, "queue_full"), 0) >= 1

    asyncio.run(main())
    settled(served)


def test_a_deadline_that_passes_in_the_queue_is_429(served: Served) -> None:
    async def main() -> None:
        c = client(served, B)
        forget_estimates(served)  # so it is queued, and shed when its deadline passes
        hold(served)
        try:
            start = time.perf_counter()
            with pytest.raises(openai.RateLimitError) as info:
                await c.completions.create(
                    model="sim:h100-8b",
                    prompt=prompt(40),
                    max_tokens=2,
                    extra_headers={"x-llm-d-slo-ttft-ms": "300"},
                )
            assert 0.25 < time.perf_counter() - start < 5
            r = info.value.response
            assert r.json()["error"]["code"] == "flow_deadline" and "retry-after" in r.headers
        finally:
            release(served)
        # a deadline that can be met is no refusal
        out = await c.completions.create(
            model="sim:h100-8b",
            prompt=prompt(41),
            max_tokens=2,
            extra_headers={"x-kvroute-slo-ttft-ms": "5000"},
        )
        assert out.choices[0].finish_reason == "length"

    asyncio.run(main())
    settled(served)
    assert flow_of(served).stats.shed.get((0, "deadline"), 0) >= 1


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_while_queued_leaves_the_queue(served: Served, stream: bool) -> None:
    async def main() -> None:
        flow = flow_of(served)
        cancelled = flow.stats.cancelled
        body = {"model": "sim:h100-8b", "prompt": prompt(50), "max_tokens": 2, "stream": stream}
        hold(served)
        try:
            async with httpx.AsyncClient(timeout=30) as http:
                task = asyncio.ensure_future(
                    http.post(
                        served.url + "/v1/completions",
                        json=body,
                        headers={"Authorization": f"Bearer {A}"},
                    )
                )
                await _until(lambda: flow.waiting == 1)
                task.cancel()  # hangs up
                with pytest.raises(asyncio.CancelledError):
                    await task
            await _until(lambda: flow.waiting == 0, 10)
            assert flow.stats.cancelled == cancelled + 1
        finally:
            release(served)

    asyncio.run(main())
    settled(served)


def test_no_request_is_lost_under_a_mixed_burst(served: Served) -> None:
    """Two tenants, three bands, far more requests than room: every one answered, in
    full, and the queue, the slots and the tickets all back to nothing."""

    async def main() -> list[Any]:
        a, b = client(served, A), client(served, B)

        async def one(i: int) -> Any:
            c = a if i % 3 else b
            return await c.completions.create(
                model="sim:h100-8b",
                prompt=prompt(100 + i, 200),
                max_tokens=8,
                extra_body={"priority": i % 3 - 1, "ignore_eos": True},
            )

        return list(await asyncio.gather(*(one(i) for i in range(40))))

    flow = flow_of(served)
    bound = flow.max_waiting
    on_loop(served, lambda: setattr(flow, "max_waiting", None))  # every one may wait
    try:
        outs = asyncio.run(main())
    finally:
        on_loop(served, lambda: setattr(flow, "max_waiting", bound))
    assert all(o.usage.completion_tokens == 8 for o in outs)
    settled(served)
    assert sum(flow.stats.dispatched.values()) >= 40
    metrics = httpx.get(served.url + "/metrics", headers=_metrics_auth(), timeout=10).text
    for family in (
        "kvroute:flow_queue_length",
        'kvroute:flow_queue_wait_seconds_bucket{band="-1"',
        "kvroute:flow_dispatches_total",
        'kvroute:flow_shed_total{band="0",cause="queue_full"}',
    ):
        assert family in metrics, family


def _metrics_auth() -> dict[str, str]:
    from ...prom import METRICS_KEY

    return {"Authorization": f"Bearer {METRICS_KEY}"}


async def _until(cond: Callable[[], bool], timeout: float = 10) -> None:
    end = time.perf_counter() + timeout
    while not cond():
        assert time.perf_counter() < end, "timed out"
        await asyncio.sleep(0.02)
