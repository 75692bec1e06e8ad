"""``kvroute bench`` without a server: statistics, request bodies, the SSE parser, and one
request's outcome for each way a server can answer (httpx's MockTransport)."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from kvroute.bench.loadgen import (
    Breaker,
    Record,
    StreamError,
    describe_failure,
    run_load,
    send_one,
    sse_events,
)
from kvroute.bench.report import format_table, load_result, percentile, summarize, to_json
from kvroute.bench.sources import (
    Planned,
    fit_context,
    pick_key,
    plan,
    scale_lengths,
    tokens_to_text,
)
from kvroute.deploy.cli import main
from kvroute.router.responses import REPLICA_HEADER
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

    from kvroute.replica.models import tiny_model_path

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
    from kvroute.bench.command import _tokenizer_facts
    from kvroute.replica.models import tiny_model_path

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
class Chunks:
    def __init__(self, parts: list[bytes]) -> None:
        self.parts = parts

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        for p in self.parts:
            yield p


async def collect(parts: list[bytes]) -> list[str]:
    return [d async for d in sse_events(Chunks(parts))]  # type: ignore[arg-type]


async def test_sse_parser_framing() -> None:
    raw = b'data: {"a": 1}\n\n: keep-alive\n\ndata: {"b":\ndata: 2}\r\n\r\n'
    raw += b"data: x\n\ndata: [DONE]\n\n"
    for size in (1, 3, 7, len(raw)):
        parts = [raw[i : i + size] for i in range(0, len(raw), size)]
        assert await collect(parts) == ['{"a": 1}', '{"b":\n2}', "x"]
    assert await collect([b"data: tail-without-blank-line"]) == ["tail-without-blank-line"]
    with pytest.raises(StreamError):
        await collect([b'data: {"a": 1}\n\nevent: error\ndata: boom\n\n'])


def chunk(text: str, finish: str | None = None) -> bytes:
    body = {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}
    return f"data: {json.dumps(body)}\n\n".encode()


USAGE = b'data: {"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 3, ' \
    b'"total_tokens": 43, "prompt_tokens_details": {"cached_tokens": 32}}}\n\n'  # fmt: skip


def handler(request: httpx.Request) -> httpx.Response:
    body = json.loads(request.content)
    case = body["case"]
    sse = {"content-type": "text/event-stream", REPLICA_HEADER: "r1"}
    if case == "ok":
        assert request.headers["authorization"] == "Bearer k"
        timing = b': kvroute-timing {"replica_ttft_s": 0.25, "router_ttft_s": 0.5}\n\n'
        stream = chunk("a") + chunk("b") + chunk("c", "length") + USAGE + timing
        stream += b"data: [DONE]\n\n"
        return httpx.Response(200, headers=sse, content=stream)
    if case == "401":
        return httpx.Response(401, json={"error": {"message": "bad key"}})
    if case == "finish_error":
        return httpx.Response(200, headers=sse, content=chunk("a") + chunk("", "error"))
    if case == "error_body":
        err = b'data: {"error": {"message": "replica failed"}}\n\ndata: [DONE]\n\n'
        return httpx.Response(200, headers=sse, content=chunk("a") + err)
    if case == "empty":
        return httpx.Response(200, headers=sse, content=b"data: [DONE]\n\n")
    raise httpx.ConnectError("refused", request=request)


@pytest.mark.parametrize(
    ("case", "error"),
    [("ok", None), ("401", "http_401"), ("finish_error", "stream_error"),
     ("error_body", "stream_error"), ("empty", "empty_stream"), ("refused", "connect")],
)  # fmt: skip
async def test_one_request_each_outcome(case: str, error: str | None) -> None:
    req = Planned(0, 0.0, {"case": case}, "k", "salt", 40)
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        r = await send_one(client, "http://x/v1", req, 0.0, timeout=5.0)
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
    live = peak = 0

    async def slow(request: httpx.Request) -> httpx.Response:
        nonlocal live, peak
        live += 1
        peak = max(peak, live)

        async def body() -> AsyncIterator[bytes]:
            nonlocal live
            yield chunk("a")
            await asyncio.sleep(0.05 if b"quick" in request.content else 30)
            live -= 1  # before the last chunk: the client may never ask past it
            yield chunk("b", "length") + USAGE + b"data: [DONE]\n\n"

        return httpx.Response(200, headers={REPLICA_HEADER: "r0"}, content=body())

    def reqs(n: int, case: str) -> list[Planned]:
        return [Planned(i, 0.02 * i, {"case": case}, None, None, 40) for i in range(n)]

    t = httpx.MockTransport(slow)
    records, _ = await run_load("http://x/v1", reqs(10, "quick"), concurrency=3, transport=t)
    assert [r.index for r in records] == list(range(10)) and all(r.ok for r in records)
    assert peak == 3
    # Open loop, 50/s for 0.2 s: ~10 sent, each stuck after its first chunk until cancelled.
    records, wall = await run_load(
        "http://x/v1", reqs(100, "stuck"), duration=0.2, grace=0.1, transport=t
    )
    assert 5 <= len(records) <= 11 and wall < 1.0
    assert all(r.error == "cancelled" for r in records)
    assert all(r.replica == "r0" and r.ttft_s is not None for r in records)  # kept


async def test_a_closed_loop_reuses_its_connection() -> None:
    """After ``[DONE]`` the client reads the body to its end, as the openai client does: a
    response left half-read closes its connection, and every request would pay (and make
    the server pay) a new one. A real socket server counts the connections."""
    connections = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        while True:
            head = await reader.readuntil(b"\r\n\r\n") if not reader.at_eof() else b""
            if not head:
                break
            length = next(
                int(line.split(b":")[1])
                for line in head.lower().split(b"\r\n")
                if line.startswith(b"content-length:")
            )
            await reader.readexactly(length)
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n"
            )
            for piece in (chunk("a"), chunk("b", "length") + USAGE, b"data: [DONE]\n\n"):
                writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        reqs = plan(make_workload("chat", 6), "m", closed_loop=True, vocab_size=256)
        records, _ = await run_load(f"http://127.0.0.1:{port}/v1", reqs, concurrency=1, timeout=5)
    finally:
        server.close()
    assert [r.error for r in records] == [None] * 6
    assert [r.output_tokens for r in records] == [3] * 6
    assert connections == 1
