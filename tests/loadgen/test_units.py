"""``kvroute bench`` without a server: statistics, request bodies, the SSE parser, and one
request's outcome for each way a real (loopback) server can answer."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvroute.deploy.cli import main
from kvroute.loadgen.report import format_table, load_result, percentile, summarize, to_json
from kvroute.loadgen.sending import (
    Breaker,
    Record,
    SSEReader,
    StreamError,
    describe_failure,
    run_load,
    send_one,
)
from kvroute.loadgen.sources import (
    Planned,
    fit_context,
    pick_key,
    plan,
    scale_lengths,
    tokens_to_text,
)
from kvroute.router.api.responses import REPLICA_HEADER
from kvroute.router.backends.wire import BackendPool
from kvroute.sim.traces import TraceRequest, prompt_tokens, specs_from_trace
from kvroute.sim.workloads import RequestSpec, TokenSource, make_workload


# -- statistics -----------------------------------------------------------------------------
def test_percentiles_interpolate_linearly() -> None:
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 50) == 2.5
    assert percentile(xs, 90) == pytest.approx(3.7)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    big = list(range(1, 101))
    assert percentile(big, 99) == pytest.approx(99.01)


def rec(i: int, ttft: float | None, itl: list[float], **kw: object) -> Record:
    return Record(index=i, start_s=0.0, ttft_s=ttft, e2e_s=(ttft or 0) + sum(itl), itl_s=itl, **kw)


def test_goodput_counts_requests_meeting_both_slos() -> None:
    records = [
        rec(0, 0.1, [0.01, 0.01, 0.01]),  # meets both
        rec(1, 0.5, [0.01]),  # TTFT too slow
        rec(2, 0.1, [0.01] * 9 + [0.5]),  # p90 interpolates to 0.059: meets; mean 0.059 too
        rec(3, 0.1, [0.2, 0.2, 0.01]),  # p90 0.2 fails, mean 0.137 fails
        rec(4, 0.1, []),  # one token: no gap to miss
        rec(5, None, [], error="http_429"),  # never counts
    ]
    s = summarize(records, wall_s=2.0, slo_ttft=0.2, slo_itl=0.1, itl_stat="p90")
    assert s["goodput"]["met"] == 3 and s["goodput"]["rate"] == 1.5
    assert s["requests"] == 6 and s["ok"] == 5 and s["errors"] == {"http_429": 1}
    assert s["request_rate"] == 2.5
    records[2].itl_s = [0.01] * 8 + [0.5, 0.5]  # p90 0.5 fails, mean 0.108 fails
    assert summarize(records, 2.0, 0.2, 0.1, "p90")["goodput"]["met"] == 2
    records[2].itl_s = [0.01] * 17 + [0.5, 0.5, 0.5]  # p90 0.5 fails; mean 0.0835 meets
    assert summarize(records, 2.0, 0.2, 0.1, "mean")["goodput"]["met"] == 3
    assert summarize(records, 2.0, 0.2, 0.1, "p90")["goodput"]["met"] == 2
    assert summarize(records, 2.0, None, None)["goodput"]["met"] == 5


def test_summary_latencies_hit_rate_replicas() -> None:
    records = [
        rec(0, 0.1, [0.02, 0.04], replica="r0", prompt_tokens=100, cached_tokens=0,
            output_tokens=3),
        rec(1, 0.3, [0.06], replica="r1", prompt_tokens=100, cached_tokens=64,
            output_tokens=2),
        rec(2, None, [], replica="r1", error="stream_error"),
    ]  # fmt: skip
    records[1].replica_ttft_s = 0.25
    s = summarize(records, wall_s=1.0)
    assert s["ttft_outside_replica_s"]["n"] == 1
    assert s["ttft_outside_replica_s"]["mean"] == pytest.approx(0.05)
    assert s["ttft_s"]["mean"] == pytest.approx(0.2) and s["ttft_s"]["p50"] == pytest.approx(0.2)
    assert s["itl_s"]["n"] == 3 and s["itl_s"]["mean"] == pytest.approx(0.04)
    assert s["itl_mean_per_request_s"]["mean"] == pytest.approx(0.045)
    assert s["hit_rate"] == pytest.approx(64 / 200)
    assert s["per_replica"] == {"r0": 1, "r1": 2}
    assert s["output_token_rate"] == 5.0
    empty = summarize([], 1.0)
    assert math.isnan(empty["hit_rate"]) and math.isnan(empty["ttft_s"]["p99"])


def test_hits_by_tier_in_the_summary_and_the_table() -> None:
    records = [
        rec(0, 0.1, [0.02], prompt_tokens=100, cached_tokens=64, output_tokens=2,
            cached_tokens_by_tier={"CPU": 48}),
        rec(1, 0.1, [0.02], prompt_tokens=100, cached_tokens=32, output_tokens=2,
            cached_tokens_by_tier={"STORAGE": 32}),
        rec(2, 0.1, [0.02], prompt_tokens=100, cached_tokens=16, output_tokens=2),
    ]  # fmt: skip
    s = summarize(records, wall_s=1.0)
    assert s["cached_tokens_by_tier"] == {"GPU": 32, "CPU": 48, "STORAGE": 32}
    device_only = summarize(records[2:], wall_s=1.0)
    table = format_table(
        [{"label": "tiers", "summary": s}, {"label": "dev", "summary": device_only}]
    )
    assert "| prefix hits by tier (tokens) | GPU 32, CPU 48, STORAGE 32 | GPU 16 |" in table
    alone = format_table([{"label": "dev", "summary": device_only}])
    assert "prefix hits by tier" not in alone


def test_json_round_trip_and_side_by_side_table(tmp_path: Path) -> None:
    records = [rec(0, 0.1, [0.02], replica="r0", prompt_tokens=10, cached_tokens=5)]
    paths = []
    for label in ("kv", "round_robin"):
        s = summarize(records, 1.0)
        p = tmp_path / f"{label}.json"
        p.write_bytes(to_json(label, {"source": "chat"}, s, records))
        paths.append(p)
    back = load_result(paths[0])
    assert back["records"] == records and back["label"] == "kv"
    none = summarize([], 1.0)
    (tmp_path / "empty.json").write_bytes(to_json("empty", {}, none, []))
    table = format_table([load_result(p) for p in [*paths, tmp_path / "empty.json"]])
    assert "| metric | kv | round_robin | empty |" in table
    assert "50.0%" in table and "requests on r0" in table
    (tmp_path / "bad.json").write_text("[1]")
    assert main(["bench", "report", str(tmp_path / "bad.json")]) == 2
    # No source is a quick run; with no server there, it stops before sending: 1.
    assert main(["bench", "--url", "http://127.0.0.1:9/v1"]) == 1
    assert main(["bench", "--workload", "chat", "--speed", "0"]) == 2


# -- what is sent ---------------------------------------------------------------------------
def test_token_prompts_are_the_token_sources_tokens() -> None:
    specs = make_workload("tenants", 20, seed=3)
    planned = plan(specs, "m", keys=["a", "b", "c"], vocab_size=256)
    source = TokenSource(256)
    for spec, p in zip(specs, planned, strict=True):
        want = np.frombuffer(source.prompt_bytes(spec), dtype="<u4").tolist()
        assert p.body["prompt"] == want and p.prompt_len == spec.input_length
        assert max(want) < 256
        assert p.body["max_tokens"] == spec.output_length and p.body["ignore_eos"] is True
        assert p.body["temperature"] == 0.0 and p.body["stream"] is True
        assert p.body["stream_options"] == {"include_usage": True}
        assert p.body["cache_salt"] == spec.cache_salt and p.cache_salt == spec.cache_salt
        assert p.api_key == pick_key(["a", "b", "c"], spec.cache_salt, p.index)
    assert planned[0].at_s == 0.0  # the first request at once, the rest at their offsets
    assert [p.at_s for p in planned] == pytest.approx([s.arrival_s - specs[0].arrival_s
                                                       for s in specs])  # fmt: skip
    # A trace's blocks are the traces module's own tokens.
    trace = [TraceRequest(0.0, 700, 5, (11, 12)), TraceRequest(0.5, 512, 5, (11,))]
    tp = plan(specs_from_trace(trace), "m", vocab_size=1000)
    assert tp[0].body["prompt"] == prompt_tokens(trace[0], 1000)
    assert tp[1].body["prompt"] == tp[0].body["prompt"][:512]
    assert "cache_salt" not in tp[0].body and tp[1].at_s == 0.5


def test_text_prompts_map_one_char_per_token() -> None:
    printable = list(range(32, 127))
    assert tokens_to_text(printable) == "".join(map(chr, printable))
    every = [*range(256), 128_255, 99_999]
    text = tokens_to_text(every)
    assert len(text) == len(every) and all(32 <= ord(c) <= 126 for c in text)
    assert tokens_to_text(every) == text  # deterministic
    from transformers import AutoTokenizer

    from kvroute.replica.model.models import tiny_model_path

    tok = AutoTokenizer.from_pretrained(tiny_model_path())
    assert tok(text).input_ids == [ord(c) for c in text]  # tiny: characters are tokens
    spec = RequestSpec(0.0, ((5, 40),), 3)
    body = plan([spec], "m", prompt_format="text", vocab_size=256)[0].body
    tokens = plan([spec], "m", vocab_size=256)[0].body["prompt"]
    assert body["prompt"] == tokens_to_text(tokens) and len(body["prompt"]) == 40


def test_keys_pacing_and_scaling() -> None:
    keys = ["k0", "k1"]
    assert pick_key([], "x", 0) is None
    assert pick_key(keys, "tenant-7", 0) == pick_key(keys, "tenant-7", 99)  # salt decides
    assert {pick_key(keys, None, i) for i in range(4)} == {"k0", "k1"}
    specs = make_workload("chat", 50, seed=1)
    a = plan(specs, "m", rate=5.0, seed=7)
    assert [p.at_s for p in a] == [p.at_s for p in plan(specs, "m", rate=5.0, seed=7)]
    gaps = np.diff([0.0] + [p.at_s for p in a])
    assert (gaps > 0).all() and 0.05 < gaps.mean() < 0.6
    assert all(p.at_s is None for p in plan(specs, "m", closed_loop=True))
    s = RequestSpec(1.0, ((1, 1000), (2, 10)), 300, "t")
    small = scale_lengths(s, 0.05, 8)
    assert small.segments == ((1, 50), (2, 1)) and small.output_length == 8
    assert small.cache_salt == "t" and small.arrival_s == 1.0
    src = TokenSource(256)
    assert src.prompt_bytes(small)[:200] == src.prompt_bytes(s)[:200]  # prefix kept


def test_requests_fit_the_context_and_skip_avoided_ids() -> None:
    s = RequestSpec(1.0, ((1, 1000), (2, 500), (3, 10)), 300, "t")
    assert fit_context(s, 2000) is s  # fits: unchanged
    cut = fit_context(s, 1200)  # the answer first stays whole, the prompt's tail goes
    assert cut.segments == ((1, 900),) and cut.output_length == 300
    long_answer = fit_context(RequestSpec(0.0, ((1, 100),), 5000, None), 1000)
    assert long_answer.segments == ((1, 100),) and long_answer.output_length == 500
    src = TokenSource(256)
    assert src.prompt_bytes(cut) == src.prompt_bytes(s)[: 4 * 900]  # a prefix of the full one
    specs = make_workload("chat", 20, seed=3)
    plain = plan(specs, "m", vocab_size=8)
    avoided = plan(specs, "m", vocab_size=8, avoid_ids=[0, 7, 3])
    for a, b in zip(plain, avoided, strict=True):
        want = [{0: 1, 7: 1, 3: 4}.get(t, t) for t in a.body["prompt"]]
        assert b.body["prompt"] == want


def test_a_tokenizer_folder_gives_vocabulary_context_and_special_ids() -> None:
    from kvroute.loadgen.command import _tokenizer_facts
    from kvroute.replica.model.models import tiny_model_path

    vocab, context, special = _tokenizer_facts(str(tiny_model_path()))
    assert (vocab, context, sorted(special)) == (261, 8192, [256, 257, 258, 259, 260])
    planned = plan(make_workload("chat", 10), "m", vocab_size=vocab, avoid_ids=special)
    assert max(max(p.body["prompt"]) for p in planned) < 256  # no special token is sent


def test_breaker_trips_on_failures_in_a_row_only() -> None:
    b = Breaker(3)
    bad = Record(index=0, start_s=0.0, error="http_400", detail="prompt: too long")
    ok, cancelled = Record(index=1, start_s=0.0), Record(index=2, start_s=0.0, error="cancelled")
    assert not any(b.add(r) for r in (bad, bad, ok, bad, cancelled, bad))
    assert b.add(bad) and b.last is bad and b.in_a_row == 3
    assert describe_failure(bad) == "HTTP 400: prompt: too long"
    assert describe_failure(Record(index=0, start_s=0.0, error="timeout")) == "timeout"
    assert not any(Breaker(0).add(bad) for _ in range(100))  # 0: never


# -- SSE and one request --------------------------------------------------------------------
def events_of(raw: bytes) -> list[str]:
    """Body lines as :mod:`kvroute.router.backends.wire` hands them over (no newline, no CR)."""
    out: list[str] = []
    sse = SSEReader(out.append)
    for line in raw.split(b"\n"):
        sse.line(line.rstrip(b"\r"))
    sse.end()
    return out


def test_sse_reader_framing() -> None:
    raw = b'data: {"a": 1}\n\n: keep-alive\n\ndata: {"b":\ndata: 2}\r\n\r\n'
    assert events_of(raw + b"data: x\n\ndata: [DONE]\n\ndata: after\n\n") == [
        '{"a": 1}',
        '{"b":\n2}',
        "x",
    ]
    assert events_of(b"data: tail-without-blank-line") == ["tail-without-blank-line"]
    with pytest.raises(StreamError):
        events_of(b'data: {"a": 1}\n\nevent: error\ndata: boom\n\n')


def chunk(text: str, finish: str | None = None) -> bytes:
    body = {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}
    return f"data: {json.dumps(body)}\n\n".encode()


USAGE = b'data: {"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 3, ' \
    b'"total_tokens": 43, "prompt_tokens_details": {"cached_tokens": 32}}}\n\n'  # fmt: skip

# A response: status, headers, then the body's pieces (each its own chunk and write; a
# piece that is a float is a pause of that many seconds instead).
Answer = tuple[int, dict[str, str], list["bytes | float"]]


class FakeServer:
    """A real HTTP/1.1 server on loopback that answers each POST with ``respond(body,
    headers)``: chunked, kept alive. Counts connections and requests in flight."""

    def __init__(self, respond: Callable[[dict[str, Any], dict[str, str]], Answer]) -> None:
        self.respond = respond
        self.connections = self.live = self.peak = 0
        self.server: asyncio.base_events.Server | None = None

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1"

    async def drained(self, timeout: float = 2.0) -> bool:
        """Whether every response ended (or its client went) within ``timeout``."""
        for _ in range(int(timeout / 0.02)):
            if self.live == 0:
                break
            await asyncio.sleep(0.02)
        return self.live == 0

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    break
                lines = head.decode("latin-1").split("\r\n")
                headers = {
                    k.strip().lower(): v.strip()
                    for k, _, v in (line.partition(":") for line in lines[1:] if line)
                }
                body = json.loads(await reader.readexactly(int(headers["content-length"])))
                status, extra, pieces = self.respond(body, headers)
                self.live += 1
                self.peak = max(self.peak, self.live)
                try:
                    out = f"HTTP/1.1 {status} X\r\ntransfer-encoding: chunked\r\n"
                    out += "".join(f"{k}: {v}\r\n" for k, v in extra.items()) + "\r\n"
                    writer.write(out.encode())
                    for piece in pieces:
                        if isinstance(piece, float):  # a pause, cut short by the client's close
                            with contextlib.suppress(TimeoutError):
                                if not await asyncio.wait_for(reader.read(1), piece):
                                    return
                            continue
                        writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                        await writer.drain()
                    writer.write(b"0\r\n\r\n")
                    await writer.drain()
                finally:
                    self.live -= 1
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()


def answer(body: dict[str, Any], headers: dict[str, str]) -> Answer:
    case = body["case"]
    sse = {"content-type": "text/event-stream", REPLICA_HEADER: "r1"}
    if case == "ok":
        assert headers["authorization"] == "Bearer k"
        timing = b': kvroute-timing {"replica_ttft_s": 0.25, "router_ttft_s": 0.5}\n\n'
        stream = chunk("a") + chunk("b") + chunk("c", "length") + USAGE + timing
        stream += b"data: [DONE]\n\n"
        # Cut anywhere: mid-line, mid-event, one byte at a time at the start.
        return 200, sse, [*(stream[i : i + 1] for i in range(7)), stream[7:50], stream[50:]]
    if case == "401":
        return 401, {"content-type": "application/json"}, [b'{"error": {"message": "bad key"}}']
    if case == "finish_error":
        return 200, sse, [chunk("a") + chunk("", "error")]
    if case == "error_body":
        err = b'data: {"error": {"message": "replica failed"}}\n\ndata: [DONE]\n\n'
        return 200, sse, [chunk("a") + err]
    if case == "event_error":
        return 200, sse, [chunk("a"), b"event: error\ndata: boom\n\n"]
    if case == "bad_json":
        return 200, sse, [b"data: {not json\n\n"]
    if case == "empty":
        return 200, sse, [b"data: [DONE]\n\n"]
    raise AssertionError(case)


@pytest.mark.parametrize(
    ("case", "error"),
    [("ok", None), ("401", "http_401"), ("finish_error", "stream_error"),
     ("error_body", "stream_error"), ("event_error", "stream_error"),
     ("bad_json", "bad_chunk"), ("empty", "empty_stream")],
)  # fmt: skip
async def test_one_request_each_outcome(case: str, error: str | None) -> None:
    req = Planned(0, 0.0, {"case": case}, "k", "salt", 40)
    async with FakeServer(answer) as url:
        pool = BackendPool(url, keep_headers=(REPLICA_HEADER,))
        r = await send_one(pool, req, 0.0, timeout=5.0)
        pool.close()
    assert r.error == error
    if case == "401":
        assert r.detail == "bad key"
    if error is None:
        assert r.replica == "r1" and r.ttft_s is not None and len(r.itl_s) == 2
        assert (r.prompt_tokens, r.cached_tokens, r.output_tokens) == (40, 32, 3)
        assert r.e2e_s is not None and r.e2e_s >= r.ttft_s and r.cache_salt == "salt"
        assert (r.replica_ttft_s, r.router_ttft_s) == (0.25, 0.5)


async def test_nothing_listening_is_counted_not_raised() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    reqs = plan(make_workload("chat", 5), "m", closed_loop=True, vocab_size=256)
    records, _ = await run_load(f"http://127.0.0.1:{port}/v1", reqs, concurrency=2, timeout=5)
    assert [r.error for r in records] == ["connect"] * 5
    # With a breaker, a closed loop stops sending after 4 failures in a row.
    reqs = plan(make_workload("chat", 50), "m", closed_loop=True, vocab_size=256)
    url, breaker = f"http://127.0.0.1:{port}/v1", Breaker(4)
    records, _ = await run_load(url, reqs, concurrency=2, timeout=5, breaker=breaker)
    assert breaker.tripped and 4 <= len(records) <= 6
    assert {r.error for r in records} <= {"connect", "cancelled"}


async def test_closed_loop_holds_c_in_flight_and_duration_cancels() -> None:
    def slow(body: dict[str, Any], headers: dict[str, str]) -> Answer:
        pause = 0.05 if body["case"] == "quick" else 30.0
        last = chunk("b", "length") + USAGE + b"data: [DONE]\n\n"
        return 200, {REPLICA_HEADER: "r0"}, [chunk("a"), pause, last]

    def reqs(n: int, case: str) -> list[Planned]:
        return [Planned(i, 0.02 * i, {"case": case}, None, None, 40) for i in range(n)]

    server = FakeServer(slow)
    async with server as url:
        records, _ = await run_load(url, reqs(10, "quick"), concurrency=3)
        assert [r.index for r in records] == list(range(10)) and all(r.ok for r in records)
        assert server.peak == 3
        # Open loop, 50/s for 0.2 s: ~10 sent, each stuck after its first chunk until
        # cancelled, and the cancelled ones' connections closed (the server sees them go).
        records, wall = await run_load(url, reqs(100, "stuck"), duration=0.2, grace=0.1)
        assert 5 <= len(records) <= 11 and wall < 1.0
        assert all(r.error == "cancelled" for r in records)
        assert all(r.replica == "r0" and r.ttft_s is not None for r in records)  # kept
        assert await server.drained()


async def test_a_timeout_is_counted_and_its_connection_closed() -> None:
    def stuck(body: dict[str, Any], headers: dict[str, str]) -> Answer:
        return 200, {}, [chunk("a"), 30.0]

    server = FakeServer(stuck)
    async with server as url:
        reqs = [Planned(0, 0.0, {"case": "stuck"}, None, None, 40)]
        records, _ = await run_load(url, reqs, concurrency=1, timeout=0.3)
        assert [r.error for r in records] == ["timeout"] and records[0].ttft_s is not None
        assert await server.drained()


async def test_a_closed_loop_reuses_its_connection() -> None:
    """One kept-alive connection serves a whole closed loop of one: the client reads each
    body to its end (a response left half-read would close its connection, and every
    request would pay, and make the server pay, a new one)."""

    def ok(body: dict[str, Any], headers: dict[str, str]) -> Answer:
        return 200, {}, [chunk("a"), chunk("b", "length") + USAGE, b"data: [DONE]\n\n"]

    server = FakeServer(ok)
    async with server as url:
        reqs = plan(make_workload("chat", 6), "m", closed_loop=True, vocab_size=256)
        records, _ = await run_load(url, reqs, concurrency=1, timeout=5)
    assert [r.error for r in records] == [None] * 6
    assert [r.output_tokens for r in records] == [3] * 6
    assert server.connections == 1


async def test_chunks_are_timed_as_they_arrive() -> None:
    """TTFT and inter-token gaps are the server's own pauses (the client stamps each event
    as it reads it, not when a buffer fills or the response ends)."""

    def paced(body: dict[str, Any], headers: dict[str, str]) -> Answer:
        last = chunk("c", "length") + USAGE + b"data: [DONE]\n\n"
        return 200, {}, [0.3, chunk("a"), 0.2, chunk("b"), 0.2, last]

    async with FakeServer(paced) as url:
        pool = BackendPool(url)
        r = await send_one(pool, Planned(0, 0.0, {}, None, None, 40), 0.0, timeout=5.0)
        pool.close()
    assert r.ok and r.ttft_s is not None and r.e2e_s is not None
    # Lower bounds only (the pauses guarantee them; a busy machine can only add): a client
    # that stamped events when the body ended would show gaps of ~0 and a late TTFT.
    assert r.ttft_s >= 0.3 and r.e2e_s - r.ttft_s >= 0.4
    assert len(r.itl_s) == 2 and all(gap >= 0.2 for gap in r.itl_s)
