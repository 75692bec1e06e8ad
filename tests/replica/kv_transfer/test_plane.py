"""The transfer plane over ZeroMQ: prefill on one engine, decode on another, the prompt's
blocks pulled over TCP (kv_transfer/plane.py), and the same tokens as one engine alone.

Why it matters: over a socket, a transfer can fail in ways an in-process call cannot (a
byte flipped or a frame cut on the way, a lease the source does not hold, a source that
closes, dies or stalls mid-pull, an address nobody answers). Each must end in a recompute
with the same tokens, in bounded time, with neither side's thread wedged and the next pull
served whole. And the source's server must survive whatever bytes reach it.

The engines here pull through the default link (no kv_link given: a PlaneLink and a
KVPlaneServer each); the helpers are test_pd_exactness.py's.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import zmq

from kvroute.events.kv_transfer import KIND_DONE, KIND_KEEP, KIND_PULL, KVSource, Pull
from kvroute.events.replica_api import Resume
from kvroute.replica.engine.config import EngineConfig
from kvroute.replica.engine.llm_engine import LLMEngine
from kvroute.replica.kv_transfer import fetcher
from kvroute.replica.kv_transfer.plane import KVPlaneServer, PlaneLink

from .test_pd_exactness import (
    BS,
    GREEDY,
    Pair,
    Replayed,
    check_same,
    drive,
    joined,
    prompt,
    run_unified,
    settle,
)


def plane_engine(name: str, **kw: Any) -> tuple[LLMEngine, Replayed]:
    sink = Replayed()
    cfg = EngineConfig(
        model="tiny", kv_transfer=True, replica_id=name, num_blocks=kw.pop("num_blocks", 96), **kw
    )
    engine = LLMEngine(cfg, [sink])  # no kv_link: the transfer plane
    assert isinstance(engine.kv_plane, KVPlaneServer)
    return engine, sink


def plane_pair() -> Pair:
    p, p_sink = plane_engine("p")
    d, d_sink = plane_engine("d")
    return Pair(p, d, d.kv_tiers.remote.link, {"p": p_sink, "d": d_sink})  # type: ignore[arg-type, union-attr]


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    pair = plane_pair()
    yield pair
    pair.p.close()
    pair.d.close()


@pytest.fixture(scope="module")
def unified() -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny", num_blocks=96))


@pytest.fixture
def short_deadline(monkeypatch: pytest.MonkeyPatch, pair: Pair) -> None:
    """A pull's deadline of 0.3 s whatever the link's measured speed."""
    monkeypatch.setattr(fetcher, "PULL_BASE_DEADLINE_S", 0.3)
    monkeypatch.setattr(pair.d.kv_tiers.remote, "bytes_per_s", 0.0)  # type: ignore[union-attr]


def healthy(pair: Pair) -> None:
    """Neither side's thread is wedged, and both engines keep their invariants."""
    assert pair.p.kv_plane is not None and pair.p.kv_plane.alive
    assert pair.d.kv_tiers.remote._thread.is_alive()  # type: ignore[union-attr]
    settle(pair)


def serve_through(pair: Pair, wrap: Callable[[int, memoryview, int, Any], bool]):  # type: ignore[no-untyped-def]
    """P's sender with each block passed through ``wrap(i, data, digest, sink)``."""
    sender = pair.p.kv_sender
    assert sender is not None
    inner = sender.serve

    def serve(lease, start, hashes, sink, buffers=None):  # type: ignore[no-untyped-def]
        return inner(lease, start, hashes, lambda i, d, h: wrap(i, d, h, sink), buffers)

    return serve


class TamperedSocket:
    """P's server socket, with one block's payload frame changed on its way out."""

    def __init__(self, sock: zmq.Socket, change: Callable[[memoryview], Any], block: int) -> None:
        self.sock = sock
        self.change = change
        self.block = block
        self.payloads = 0

    def send(self, data: Any, flags: int = 0, copy: bool = True, track: bool = False) -> Any:
        if not flags & zmq.SNDMORE and len(data) > 4096:  # a block's payload
            self.payloads += 1
            if self.payloads == self.block + 1:
                data = self.change(memoryview(data))
        return self.sock.send(data, flags, copy=copy, track=track)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


def flipped(data: memoryview) -> bytearray:
    out = bytearray(data)
    out[len(out) // 2] ^= 0xFF
    return out


def truncated(data: memoryview) -> memoryview:
    return data[:-7]


def split_of(pair: Pair, ids: list[int], source: KVSource | None = None):  # type: ignore[no-untyped-def]
    """P's part, then D's with ``source`` (P's handoff by default)."""
    rid = f"x{os.urandom(4).hex()}"
    pair.p.add_request(rid, ids, GREEDY, kv_handoff=True)
    first = drive(pair.p, rid)
    resume = Resume(output_token_ids=first.token_ids, sent_chars=len(first.text))
    pair.d.add_request(
        f"{rid}-d", ids, GREEDY, resume=resume, kv_source=source or KVSource.of(first.handoff)
    )
    t0 = time.monotonic()
    rest = drive(pair.d, f"{rid}-d")
    return first, rest, time.monotonic() - t0


# -- (a) the same tokens over the plane ---------------------------------------------------------
def test_split_over_zeromq_equals_unified(pair: Pair, unified: LLMEngine) -> None:
    assert pair.p.kv_sender.endpoint.startswith("tcp://127.0.0.1:")  # type: ignore[union-attr]
    assert not pair.p.kv_sender.endpoint.endswith(":*")  # type: ignore[union-attr]
    link = pair.d.kv_tiers.remote.link  # type: ignore[union-attr]
    assert isinstance(link, PlaneLink)
    blocks = link.stats["blocks"]
    first, rest = check_same(pair, unified, prompt(100, 1), GREEDY)
    assert first.handoff.endpoint == pair.p.kv_plane.endpoint  # type: ignore[union-attr]
    assert rest.remote_tokens == 6 * BS  # every full block pulled over TCP
    assert link.stats["blocks"] == blocks + 6
    assert pair.p.kv_plane.stats["dones"] >= 1  # type: ignore[union-attr]
    healthy(pair)


def test_partial_pull_over_zeromq(pair: Pair, unified: LLMEngine) -> None:
    ids = prompt(120, 4)
    run_unified(pair.d, ids[:50], GREEDY)  # 3 blocks cached on D: 4 pulled
    settle(pair)
    _, rest = check_same(pair, unified, ids, GREEDY)
    assert rest.remote_tokens == (7 - 3) * BS


@pytest.mark.parametrize("zero_copy", [True, False])
def test_blocks_read_a_chunk_at_a_time_arrive_each_as_itself(
    pair: Pair, unified: LLMEngine, monkeypatch: pytest.MonkeyPatch, zero_copy: bool
) -> None:
    """The sender reads several blocks before it sends the first (on CUDA, one gather a
    chunk): each goes out from its own buffer, none is reused while ZeroMQ sends it."""
    plane = pair.p.kv_plane
    assert plane is not None and pair.p.kv_sender is not None
    monkeypatch.setattr(pair.p.kv_sender.reader, "chunk_blocks", 4)
    monkeypatch.setattr(plane, "zero_copy", zero_copy)
    for n in (100, 150):  # 6 blocks (a chunk and a short one), then 9
        _, rest = check_same(pair, unified, prompt(n, n + zero_copy), GREEDY)  # fresh prompts
        assert rest.remote_tokens == (n - 1) // BS * BS
    assert not plane._handed  # every buffer read into was sent or went back to the spares
    healthy(pair)


# -- (b) faults: recompute, the same tokens, nothing wedged ---------------------------------------
@pytest.mark.parametrize(
    ("change", "seed"), [(flipped, 40), (truncated, 50)], ids=["flipped-byte", "truncated"]
)
def test_damaged_block_recomputes_from_there(
    pair: Pair, unified: LLMEngine, change: Callable[[memoryview], Any], seed: int
) -> None:
    server = pair.p.kv_plane
    assert server is not None
    real = server._sock
    server._sock = TamperedSocket(real, change, block=2)  # type: ignore[assignment]
    failures = pair.d.kv_tiers.remote.stats["failures"]  # type: ignore[union-attr]
    try:
        _, rest = check_same(pair, unified, prompt(100, seed), GREEDY)
    finally:
        server._sock = real
    assert rest.remote_tokens == 2 * BS  # the blocks before the bad one were used
    assert pair.d.kv_tiers.remote.stats["failures"] == failures + 1  # type: ignore[union-attr]
    healthy(pair)
    _, rest = check_same(pair, unified, prompt(100, seed + 1), GREEDY)  # the next is whole
    assert rest.remote_tokens == 6 * BS


def test_wrong_lease_is_refused(pair: Pair, unified: LLMEngine) -> None:
    ids = prompt(100, 13)
    ref = run_unified(unified, ids, GREEDY)
    p_sender = pair.p.kv_sender
    assert p_sender is not None
    refused = p_sender.stats["pulls_refused"]
    forged = KVSource(
        replica_id="p", endpoint=p_sender.endpoint, lease=os.urandom(16), num_blocks=6
    )
    first, rest, _ = split_of(pair, ids, forged)
    assert joined(first, rest)[0] == ref.token_ids
    assert rest.remote_tokens == 0
    assert p_sender.stats["pulls_refused"] == refused + 1
    p_sender.done(first.handoff.lease)  # D released the forged lease, not this one
    healthy(pair)


def test_unreachable_source_is_bounded(
    pair: Pair, unified: LLMEngine, short_deadline: None
) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ids = prompt(100, 14)
    ref = run_unified(unified, ids, GREEDY)
    link = pair.d.kv_tiers.remote.link  # type: ignore[union-attr]
    timeouts = link.stats["timeouts"]
    gone = KVSource(
        replica_id="p", endpoint=f"tcp://127.0.0.1:{port}", lease=b"x" * 16, num_blocks=6
    )
    first, rest, seconds = split_of(pair, ids, gone)
    assert joined(first, rest)[0] == ref.token_ids
    assert rest.remote_tokens == 0
    assert link.stats["timeouts"] == timeouts + 1
    assert seconds < 10  # the 0.3 s deadline and the rest computed, on a slow shared CPU
    pair.p.kv_sender.done(first.handoff.lease)  # type: ignore[union-attr]
    healthy(pair)


def test_slow_source_past_the_deadline(
    pair: Pair, unified: LLMEngine, short_deadline: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Block 2 comes 1 s late: the puller stops at the deadline with blocks 0 and 1, and
    the late frames never reach the next pull (its socket was discarded)."""

    def slow(i: int, data: memoryview, digest: int, sink: Any) -> bool:
        if i == 2:
            time.sleep(1.0)
        return sink(i, data, digest)

    monkeypatch.setattr(pair.p.kv_sender, "serve", serve_through(pair, slow))
    ids = prompt(100, 15)
    ref = run_unified(unified, ids, GREEDY)
    link = pair.d.kv_tiers.remote.link  # type: ignore[union-attr]
    timeouts = link.stats["timeouts"]
    first, rest, seconds = split_of(pair, ids)
    assert joined(first, rest)[0] == ref.token_ids
    assert rest.remote_tokens == 2 * BS
    assert link.stats["timeouts"] == timeouts + 1
    assert seconds < 10
    monkeypatch.undo()
    time.sleep(1.2)  # the source's late sends find the puller gone
    failures = pair.p.kv_plane.stats["send_failures"]  # type: ignore[union-attr]
    assert failures >= 1
    healthy(pair)
    _, rest = check_same(pair, unified, prompt(100, 16), GREEDY)
    assert rest.remote_tokens == 6 * BS
    assert link.stats["stale"] == 0


def test_source_dead_mid_pull_without_a_word(
    pair: Pair, unified: LLMEngine, short_deadline: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The source stops sending at block 2 and never ends the pull: the puller's deadline
    bounds it; the source's server lives on (the failure is its pull's alone)."""

    def dies(i: int, data: memoryview, digest: int, sink: Any) -> bool:
        if i == 2:
            raise RuntimeError("the source died")
        return sink(i, data, digest)

    monkeypatch.setattr(pair.p.kv_sender, "serve", serve_through(pair, dies))
    ids = prompt(100, 17)
    ref = run_unified(unified, ids, GREEDY)
    first, rest, seconds = split_of(pair, ids)
    monkeypatch.undo()
    assert joined(first, rest)[0] == ref.token_ids
    assert rest.remote_tokens == 2 * BS
    assert seconds < 10
    healthy(pair)


def test_source_engine_closed_mid_pull(unified: LLMEngine) -> None:
    pair = plane_pair()
    reached, release = threading.Event(), threading.Event()

    def pauses(i: int, data: memoryview, digest: int, sink: Any) -> bool:
        if i == 2:
            reached.set()
            release.wait(5)
        return sink(i, data, digest)

    pair.p.kv_sender.serve = serve_through(pair, pauses)  # type: ignore[method-assign, union-attr]

    def close_source() -> None:
        reached.wait(30)
        closer = threading.Thread(target=pair.p.close)
        closer.start()
        time.sleep(0.05)
        release.set()
        closer.join(10)

    killer = threading.Thread(target=close_source)
    killer.start()
    ids = prompt(100, 18)
    ref = run_unified(unified, ids, GREEDY)
    first, rest, seconds = split_of(pair, ids)
    killer.join(10)
    assert joined(first, rest)[0] == ref.token_ids
    assert rest.remote_tokens == 2 * BS  # what came before the source closed
    assert seconds < 10
    assert not pair.p.kv_plane.alive  # type: ignore[union-attr]
    assert pair.d.kv_tiers.remote._thread.is_alive()  # type: ignore[union-attr]
    d_pool = pair.d.kv_cache_manager.block_pool
    d_pool.check_invariants()
    assert d_pool.get_num_free_blocks() == d_pool.num_blocks
    assert pair.replayed["d"].counts == d_pool.cached_hash_counts()
    pair.d.close()
    assert pair.d._kv_plane_link._closed  # type: ignore[union-attr]
    assert not pair.d.kv_plane.alive  # type: ignore[union-attr]


# -- (c) the server survives any bytes ------------------------------------------------------------
def test_malformed_frames_are_counted_and_skipped(pair: Pair, unified: LLMEngine) -> None:
    server = pair.p.kv_plane
    assert server is not None
    before = server.stats["malformed"]
    enc = msgspec.msgpack.encode
    bad_pull = enc({"pull_id": 1, "lease": b"l", "start": 0, "hashes": [1, 2]})
    junk = [
        [b"X", b"junk"],  # an unknown kind
        [KIND_PULL, b"\xc1\xff"],  # not msgpack
        [KIND_PULL, bad_pull],  # hashes that are not bytes
        [KIND_PULL],  # a frame short
        [KIND_PULL, enc(Pull(pull_id=1, lease=b"l", start=0, hashes=[])), b"extra"],
        [KIND_KEEP, b"\x00"],
        [KIND_DONE, enc({"lease": 7})],
    ]
    ctx = zmq.Context.instance()
    rogue = ctx.socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.connect(server.endpoint)
    try:
        for frames in junk:
            rogue.send_multipart(frames)
        deadline = time.monotonic() + 10
        while server.stats["malformed"] < before + len(junk) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        rogue.close()
    assert server.stats["malformed"] == before + len(junk)
    assert server.alive
    _, rest = check_same(pair, unified, prompt(100, 19), GREEDY)  # the next pull is served
    assert rest.remote_tokens == 6 * BS
    healthy(pair)


def test_link_ignores_stale_frames_and_closes_promptly() -> None:
    """A frame of another pull is dropped; close() ends a pull waiting on a frame."""
    ctx = zmq.Context.instance()
    fake = ctx.socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    port = fake.bind_to_random_port("tcp://127.0.0.1")
    link = PlaneLink()
    src = KVSource(replica_id="f", endpoint=f"tcp://127.0.0.1:{port}", lease=b"l", num_blocks=1)
    got: list[tuple[int, str]] = []
    puller = threading.Thread(
        target=lambda: got.append(link.pull(src, 0, [b"h"], lambda *_: True, 30.0))
    )
    puller.start()
    try:
        assert fake.poll(5000)
        peer, _, body = fake.recv_multipart()
        pull = msgspec.msgpack.decode(body, type=Pull)
        stale = msgspec.msgpack.encode([pull.pull_id + 100, 0, 4, 0])
        fake.send_multipart([peer, b"B", stale, b"abcd"])
        time.sleep(0.2)
        t0 = time.monotonic()
        link.close()
        puller.join(5)
        assert not puller.is_alive() and time.monotonic() - t0 < 3
    finally:
        fake.close()
    assert got == [(0, "closed")]
    assert link.stats["stale"] == 1
    assert link.pull(src, 0, [b"h"], lambda *_: True, 1.0) == (0, "closed")
