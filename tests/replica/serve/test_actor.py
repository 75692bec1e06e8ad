"""ReplicaActor on a real local Ray: info, event and data-plane endpoints, streaming over the
data plane, cancellation, bad requests, and an engine death that Ray repairs by restarting
the process.

Why a real Ray and real sockets and not the plain class: what can go wrong here lives
between processes -- what crosses the boundary (Structs, exceptions), what a front door
that leaves does to its requests, what a restart does to endpoints and the event seq.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import os
import pickle
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import ray
import zmq

from kvroute.events import DEFAULT_SEED, BlockHasher, BlockSet, HashConfig
from kvroute.events import dataplane_wire as dp
from kvroute.events.framing import END_SEQ, pack_seq, unpack_seq
from kvroute.events.replica_api import (
    GenerateDelta,
    GenerateRequest,
    InvalidRequestError,
    ReplicaDeadError,
    ReplicaInfo,
    SamplingParams,
    delta_error,
)
from kvroute.events.transport import ReplicaBatch, ZmqEventSubscriber
from kvroute.replica import LLM, EngineConfig
from kvroute.replica.serve.actor import ReplicaServer, start_replica

from ...dataplane_client import collect, connect
from ...ray_session import local_ray
from ...waiting import wait_for, wait_until

BLOCK = 4
NUM_BLOCKS = 64
MAX_LEN = NUM_BLOCKS * BLOCK  # 256: the tiny model allows more, the cache does not
CONFIG = {"model": "tiny", "block_size": BLOCK, "num_blocks": NUM_BLOCKS}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=MAX_LEN - 20, ignore_eos=True)  # ~240 steps
PROMPTS = [list(range(10 + i, 10 + i + 5 + 3 * i)) for i in range(4)] + [list(range(30, 62))]


@pytest.fixture(scope="module")
def actors() -> Iterator[dict[str, Any]]:
    with local_ray() as started:
        # Both start at once: their processes load torch while the driver builds its own LLM.
        handles = {
            "main": start_replica("r0", CONFIG, num_cpus=0.5),
            # An EngineConfig works as well as a dict (and must pickle).
            "fragile": start_replica(
                "r-fragile", EngineConfig(**CONFIG), num_cpus=0.5, max_restarts=1
            ),
        }
        started.extend(handles.values())
        yield handles


@pytest.fixture(scope="module")
def replica(actors: dict[str, Any]) -> Any:
    return actors["main"]


@pytest.fixture(scope="module")
def reference() -> LLM:
    return LLM("tiny", block_size=BLOCK, num_blocks=NUM_BLOCKS)


def req(
    rid: str, prompt: list[int], sampling: SamplingParams = GREEDY, **kw: Any
) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling, **kw)


def all_blocks_free(actor: Any) -> Callable[[], bool]:
    def check() -> bool:
        s = ray.get(actor.stats.remote())
        return s["num_free_blocks"] == NUM_BLOCKS and s["num_running"] == 0

    return check


def replay_seqs(endpoint: str, start: int = 0) -> list[int]:
    """The seqs a replay from ``start`` returns, read with a raw DEALER (the wire contract)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", pack_seq(start)])
        seqs = []
        while True:
            frames = sock.recv_multipart()
            seq = unpack_seq(frames[2])
            if seq == END_SEQ:
                return seqs
            seqs.append(seq)
    finally:
        sock.close()


# -- messages ------------------------------------------------------------------------------
def test_messages_pickle_and_encode() -> None:
    spec = SamplingParams(temperature=0.5, stop=["x"], logprobs=2)
    for msg in (
        req("a", [1, 2, 3], spec, cache_salt="t"),
        GenerateDelta(request_id="a", delta_text="é", delta_token_ids=[7], finished=False),
        GenerateDelta(
            request_id="a", delta_text="", delta_token_ids=[], finished=True, logprobs=[{1: -0.5}]
        ),
    ):
        assert pickle.loads(pickle.dumps(msg)) == msg
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=type(msg)) == msg


# -- (1) info and the event endpoints ------------------------------------------------------
def test_info_and_events_match_the_cache(replica: Any) -> None:
    info: ReplicaInfo = ray.get(replica.info.remote(), timeout=60)
    assert (info.replica_id, info.topic, info.model) == ("r0", "r0", "tiny")
    assert os.path.isdir(info.model_path)  # same node
    assert info.hash_config == HashConfig("xxh3_128", DEFAULT_SEED, BLOCK)
    assert info.hash_form == "bytes"
    assert (info.block_size, info.num_blocks, info.max_model_len) == (BLOCK, NUM_BLOCKS, MAX_LEN)
    assert info.events_endpoint.startswith("tcp://127.0.0.1:")
    assert info.replay_endpoint and info.replay_endpoint.startswith("tcp://127.0.0.1:")
    assert info.events_endpoint != info.replay_endpoint
    assert info.pid != os.getpid() and not info.restarted
    assert ray.get(replica.health.remote())
    assert ray.get(replica.stats.remote())["torch_threads"] == 1  # start_replica: num_cpus 0.5

    view, lock = BlockSet(), threading.Lock()

    def on_batch(item: ReplicaBatch) -> None:
        assert item.replica_id == "r0"
        with lock:
            view.apply_batch(item.batch)

    sub = ZmqEventSubscriber(on_batch)
    try:
        assert ray.get(replica.reset_prefix_cache.remote())  # idle: empty cache, cleared event
        sub.add_publisher("r0", info.events_endpoint, info.replay_endpoint, info.topic)
        prompt = list(range(50, 63))  # 13 tokens: 3 full blocks
        out = asyncio.run(collect(replica, req("ev-1", prompt, cache_salt="tenant-a")))
        tokens = [t for d in out for t in d.delta_token_ids]
        # Cached: every full block of prompt + output except the last token (never fed back).
        hasher = BlockHasher(info.hash_algo, info.hash_seed, info.block_size)
        want = hasher.hash_blocks(prompt + tokens[:-1], cache_salt="tenant-a")
        assert len(want) == (13 + 8 - 1) // BLOCK

        def converged() -> bool:
            with lock:
                return view.counts() == dict.fromkeys(want, 1)

        wait_for(converged, 10, "subscriber view == the request's blocks")
        stats = ray.get(replica.stats.remote())
        assert stats["events_sent"] >= 2 and stats["events_dropped"] == 0
        assert stats["prefix_cache_hits"] == 0
        # The same prompt and salt again: a hit, counted by the engine.
        again = asyncio.run(collect(replica, req("ev-2", prompt, cache_salt="tenant-a")))
        assert again[-1].num_cached_tokens == 12
    finally:
        sub.close()


# -- (2) greedy streaming == offline --------------------------------------------------------
async def test_concurrent_streams_match_offline_greedy(replica: Any, reference: LLM) -> None:
    expected = reference.generate(PROMPTS, GREEDY)
    reqs = [req(f"g-{i}", p) for i, p in enumerate(PROMPTS)]
    sent0 = (await replica.stats.remote())["dataplane_messages_sent"]
    conn = await connect(replica)  # all at once on one connection, as one front door sends

    async def one(r: GenerateRequest) -> list[GenerateDelta]:
        return [d async for d in conn.stream(r)]

    try:
        results = await asyncio.gather(*(one(r) for r in reqs))
    finally:
        conn.close()
    # One message per engine step for the whole batch, not one per token (+ heartbeats).
    sent = (await replica.stats.remote())["dataplane_messages_sent"] - sent0
    assert sent < sum(len(d) for d in results) / 2, sent
    for prompt, deltas, ref in zip(PROMPTS, results, expected, strict=True):
        assert [t for d in deltas for t in d.delta_token_ids] == ref.outputs[0].token_ids
        assert "".join(d.delta_text for d in deltas) == ref.outputs[0].text
        last = deltas[-1]
        assert last.finished and not any(d.finished for d in deltas[:-1])
        assert (last.finish_reason, last.num_output_tokens) == ("length", GREEDY.max_tokens)
        assert last.num_prompt_tokens == len(prompt)
    # Logprobs arrive per delta, one entry per new token, holding the chosen token.
    spec = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2)
    deltas = await collect(replica, req("lp", PROMPTS[1], spec))
    for d in deltas:
        assert d.logprobs is not None and len(d.logprobs) == len(d.delta_token_ids)
        assert all(t in lp for t, lp in zip(d.delta_token_ids, d.logprobs, strict=True))


# -- (3) cancellation frees blocks -----------------------------------------------------------
def steps(actor: Any) -> int:
    return ray.get(actor.stats.remote())["steps"]


async def test_a_front_door_that_goes_away_has_its_requests_aborted(replica: Any) -> None:
    """No abort is sent: the connection just closes (a front door killed). The replica's
    next send to it fails, and it aborts that front door's requests."""
    start = steps(replica)
    conn = await connect(replica)
    stream = conn.stream(req("c-1", PROMPTS[0], LONG))
    for _ in range(2):
        assert not (await anext(stream)).finished
    conn.close()  # the socket is gone; the generator is never closed
    await asyncio.to_thread(wait_for, all_blocks_free(replica), 20.0, "blocks freed (gone)")
    # Run to its end, LONG takes > 200 steps: far fewer means it was aborted.
    assert steps(replica) - start < 100


async def test_the_replica_pushes_its_load_to_front_doors_that_read_it(replica: Any) -> None:
    """LOAD frames: while a request runs, reports that see it (the load a router weighs,
    with no Ray call); while idle, one at least every heartbeat interval (a router holds a
    report for a second); none to a front door of protocol version 1."""
    from kvroute.events.load import LoadReport
    from kvroute.router.fleet.replica_connection import ReplicaConnection

    info = await replica.info.remote()
    reports: list[tuple[float, LoadReport]] = []
    conn = ReplicaConnection(
        info.replica_id, info.data_endpoint, info.incarnation, "load-test", lambda *_: None,
        on_load=lambda _, r: reports.append((time.monotonic(), r)),
    )  # fmt: skip
    old = zmq.Context.instance().socket(zmq.DEALER)  # a version-1 front door
    old.setsockopt(zmq.LINGER, 0)
    old.connect(info.data_endpoint)
    old.send_multipart([dp.HELLO, dp.encoder.encode(dp.Hello("v1-door", version=1))])
    try:
        stream = conn.stream(req("load-1", PROMPTS[4], LONG))
        for _ in range(20):
            await anext(stream)
        await wait_until(
            lambda: any(r.num_running >= 1 and r.decode_context_tokens > 0 for _, r in reports),
            5,
            "a load report that sees the request",
        )
        await stream.aclose()  # aborts it
        await asyncio.to_thread(wait_for, all_blocks_free(replica), 20.0, "blocks freed")
        await wait_until(lambda: reports[-1][1].num_running == 0, 20, "an idle load report")
        idle_from = time.monotonic()
        await asyncio.sleep(1.6)  # what is under test: the reports of an idle replica
        idle = [t for t, r in reports if t >= idle_from and r.num_running == 0]
        assert len(idle) >= 2 and all(b - a < 1.0 for a, b in itertools.pairwise(idle))
        kinds = set()
        while old.poll(0):
            kinds.add(old.recv_multipart()[0])
        assert dp.HEARTBEAT in kinds and dp.LOAD not in kinds
    finally:
        conn.close()
        old.close()


async def test_consumer_leaving_early_aborts_the_request(replica: Any) -> None:
    start = steps(replica)
    conn = await connect(replica)
    # (a) the consumer breaks out and closes the stream
    stream = conn.stream(req("c-2", PROMPTS[1], LONG))
    async for delta in stream:
        assert not delta.finished
        break
    await stream.aclose()
    await asyncio.to_thread(wait_for, all_blocks_free(replica), 20.0, "blocks freed (close)")

    # (b) the consuming task is cancelled
    first = asyncio.Event()

    async def consume() -> None:
        async for _ in conn.stream(req("c-3", PROMPTS[2], LONG)):
            first.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(first.wait(), 20)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.to_thread(wait_for, all_blocks_free(replica), 20.0, "blocks freed (cancel)")

    # (c) abort(request_id) from anyone: the stream ends normally, reason "abort"
    deltas = []
    async for d in conn.stream(req("c-4", PROMPTS[3], LONG)):
        if not deltas:
            await replica.abort.remote("c-4")
        deltas.append(d)
    assert deltas[-1].finished and deltas[-1].finish_reason == "abort"
    await asyncio.to_thread(wait_for, all_blocks_free(replica), 20.0, "blocks freed (abort)")
    conn.close()
    assert steps(replica) - start < 150  # three LONG requests run out would take > 600


# -- (4) bad requests fail alone -------------------------------------------------------------
BARE = {"prompt_token_ids": [1, 2]}


def raw_request(endpoint: str, request: Any) -> GenerateDelta:
    """Sends one ADD as a caller that skipped every check would (any msgpack) on a raw
    DEALER; returns the first delta that comes back."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 20_000)
    sock.connect(endpoint)
    try:
        sock.send_multipart([dp.HELLO, msgspec.msgpack.encode(dp.Hello("raw"))])
        sock.send_multipart([dp.ADD, msgspec.msgpack.encode(request)])
        while True:
            kind, payload = sock.recv_multipart()
            if kind == dp.OUTPUTS:
                return dp.decode_outputs(payload).deltas[0]
    finally:
        sock.close()


def test_bad_requests_raise_clear_errors_and_the_actor_lives(replica: Any) -> None:
    endpoint = ray.get(replica.info.remote()).data_endpoint
    bad = [
        (req("b-1", [3 + i % 200 for i in range(MAX_LEN + 10)]), "exceed the limit of 256"),
        (req("b-2", [1, 2, 10**9]), r"token ids must be ints in \[0, 261\)"),
        # Past the shared bounds, as a caller that skipped them would send (a dict: building
        # a SamplingParams would already refuse it).
        ({**BARE, "request_id": "b-3", "sampling": {"temperature": -1.0}}, "temperature"),
        ({**BARE, "request_id": "b-6", "sampling": {"seed": 2**64 - 1}}, "seed"),  # past int64
        ({"request_id": "b-4", "prompt_token_ids": "not tokens"}, "Expected `array`"),
    ]
    for request, message in bad:
        delta = raw_request(endpoint, request)
        assert delta.finished and delta.failure == "invalid"
        with pytest.raises(InvalidRequestError, match=message) as err:
            raise delta_error(delta, "r0")  # type: ignore[misc]
        assert isinstance(err.value, ValueError)  # a 4xx for the front door
    assert ray.get(replica.health.remote())
    # A plain msgpack map works too (a caller need not build Structs).
    ok = {"request_id": "b-5", "prompt_token_ids": [5, 6, 7], "sampling": {"max_tokens": 2}}
    first = raw_request(endpoint, ok)
    assert first.failure is None and first.delta_token_ids


# -- (5) engine death: streams fail, Ray restarts the process, seq starts again at 0 -------
async def test_engine_death_restarts_the_replica(actors: dict[str, Any], reference: LLM) -> None:
    actor = actors["fragile"]
    before: ReplicaInfo = await actor.info.remote()
    warm = await collect(actor, req("f-0", PROMPTS[4]))
    assert (await actor.stats.remote())["events_last_seq"] >= 1

    conn = await connect(before)
    stream = conn.stream(req("f-1", PROMPTS[0], LONG))
    assert not (await anext(stream)).finished
    await actor.inject_engine_failure.remote("boom for the test")
    with pytest.raises(ReplicaDeadError, match="boom for the test"):
        async for _ in stream:
            pass
    conn.close()

    deadline = time.monotonic() + 45
    while True:  # calls fail while the process is down, then reach the new one
        try:
            after: ReplicaInfo = await actor.info.remote()
            if after.incarnation != before.incarnation:
                break
        except ray.exceptions.RayActorError:
            pass
        assert time.monotonic() < deadline, "the replica was not restarted"
        await asyncio.sleep(0.2)
    assert after.restarted and after.pid != before.pid and after.replica_id == "r-fragile"
    assert after.replay_endpoint is not None
    # It serves: the same greedy tokens as before the death, and as offline.
    again = await collect(actor, req("f-2", PROMPTS[4]))
    tokens = [t for d in again for t in d.delta_token_ids]
    assert tokens == [t for d in warm for t in d.delta_token_ids]
    expected = reference.generate([PROMPTS[4]], GREEDY)[0].outputs[0].token_ids
    assert tokens == expected
    assert await actor.health.remote()
    # The new publisher counts from 0 again (the request above published at least one batch;
    # the replay buffer holds every batch of this young process).
    seqs = await asyncio.to_thread(replay_seqs, after.replay_endpoint, 0)
    assert seqs[:1] == [0] and seqs == list(range(len(seqs)))


def test_a_started_replica_keeps_its_loaded_heap_out_of_the_collectors_walk() -> None:
    """Once the model is loaded, what lives (the engine, its weights' modules, torch's and
    transformers' objects) is frozen: a full collection, which pauses the engine's step
    loop, no longer walks it."""
    server = ReplicaServer("frozen", CONFIG, torch_threads=1)
    try:
        walked = {id(o) for o in gc.get_objects()}
        for obj in (server, server.engine, server.engine.llm_engine, server.dataplane):
            assert id(obj) not in walked, type(obj).__name__
        assert gc.get_freeze_count() > 0
    finally:
        server.shutdown()


async def test_in_process_server_reports_death_without_exiting(actors: dict[str, Any]) -> None:
    """Outside an actor the watchdog must not kill the host process; health() tells.
    Bound on all interfaces, the server advertises the node's address, which answers."""
    server = ReplicaServer("local", CONFIG, events_host="0.0.0.0", torch_threads=1)
    try:
        info = server.info()
        assert info.node_ip == ray.util.get_node_ip_address()
        assert info.replay_endpoint and info.replay_endpoint.startswith(f"tcp://{info.node_ip}:")
        assert info.events_endpoint.startswith(f"tcp://{info.node_ip}:")
        assert await asyncio.to_thread(replay_seqs, info.replay_endpoint) is not None
        assert server.health()
        # AsyncLLMEngine.call: fn raising fails that call only.
        with pytest.raises(ZeroDivisionError):
            await server.engine.call(lambda e: 1 / 0)
        assert (await server.stats())["num_free_blocks"] == NUM_BLOCKS
        server.inject_engine_failure("boom in-process")
        with pytest.raises(ReplicaDeadError, match="boom in-process"):
            await collect(server, req("l-1", PROMPTS[0]))
        with pytest.raises(ReplicaDeadError, match="boom in-process"):
            server.health()
        with pytest.raises(ReplicaDeadError):
            await server.stats()
        # That the watchdog leaves the process alone has no event to wait for: it looks
        # every 0.1 s, so this gives it three looks, and we are still here.
        await asyncio.sleep(0.3)
    finally:
        server.shutdown()
