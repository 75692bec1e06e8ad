"""The data plane to ``vllm serve`` over :mod:`kvroute.router.backends.wire`, against scripted
raw HTTP servers (no vLLM): SSE lines cut across any packet boundary, connections kept
alive and reused, and every way a backend can fail told apart as before (refused, 4xx,
5xx, a stream cut mid-response, a response without ``[DONE]``, a malformed line, a
client's abort closing the backend's connection).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from kvroute.events.replica_api import (
    GenerateRequest,
    ReplicaDeadError,
    ReplicaLostError,
    SamplingParams,
)
from kvroute.router.backends.connection import HttpReplicaConnection

CHUNK = (
    '{{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{{"index":0,'
    '"text":"{text}","logprobs":null,"finish_reason":{finish},"stop_reason":null,'
    '"prompt_token_ids":{prompt},"token_ids":[{tok}]}}]}}'
)
USAGE = (
    '{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[],"usage":'
    '{"prompt_tokens":40,"total_tokens":43,"completion_tokens":3,'
    '"prompt_tokens_details":{"cached_tokens":32}}}'
)


def sse(n: int = 3) -> list[bytes]:
    events = []
    for i in range(n):
        finish = '"length"' if i == n - 1 else "null"
        prompt = json.dumps(list(range(40))) if i == 0 else "null"
        text = CHUNK.format(text=f"t{i}", finish=finish, prompt=prompt, tok=100 + i)
        events.append(f"data: {text}\n\n".encode())
    events.append(f"data: {USAGE}\n\n".encode())
    events.append(b"data: [DONE]\n\n")
    return events


def chunked(parts: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, dict[str, Any]], Awaitable[None]]


class Server:
    """Answers each request on a connection with ``handler``; counts connections."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.bodies: list[dict[str, Any]] = []
        self.closed = asyncio.Event()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def _conn(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.decode().split("\r\n"):
                    if line.lower().startswith("content-length:"):
                        length = int(line.split(":")[1])
                body = json.loads(await r.readexactly(length))
                self.bodies.append(body)
                await self.handler(r, w, body)
                await w.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed.set()
        finally:
            w.close()


async def byte_by_byte(r: Any, w: asyncio.StreamWriter, body: dict[str, Any]) -> None:
    data = HEAD + chunked(sse())
    for i in range(0, len(data), 7):  # every framing and line cut across writes
        w.write(data[i : i + 7])
        await w.drain()
        await asyncio.sleep(0)


async def whole(r: Any, w: asyncio.StreamWriter, body: dict[str, Any]) -> None:
    w.write(HEAD + chunked(sse()))


def request(i: int = 0) -> GenerateRequest:
    return GenerateRequest(
        request_id=f"r{i}", prompt_token_ids=list(range(40)), sampling=SamplingParams(max_tokens=3)
    )


async def collect(conn: HttpReplicaConnection, req: GenerateRequest) -> list[Any]:
    flight = conn.submit(req)
    out = []
    while True:
        d = await asyncio.wait_for(flight.next(), 10)
        out.append(d)
        if d.finished:
            return out


async def connection(handler: Handler) -> tuple[Server, HttpReplicaConnection, list[str]]:
    server = Server(handler)
    url = await server.start()
    lost: list[str] = []
    conn = HttpReplicaConnection("b", url, "inc", "m", lambda rid, why: lost.append(why))
    return server, conn, lost


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))  # type: ignore[arg-type]


@pytest.mark.parametrize("handler", [byte_by_byte, whole])
def test_a_stream_becomes_deltas_and_its_connection_is_reused(handler: Handler) -> None:
    async def main() -> None:
        server, conn, lost = await connection(handler)
        for i in range(3):
            deltas = await collect(conn, request(i))
            ids = [t for d in deltas for t in d.delta_token_ids]
            assert ids == [100, 101, 102]
            assert "".join(d.delta_text for d in deltas) == "t0t1t2"
            last = deltas[-1]
            assert last.finish_reason == "length" and last.num_cached_tokens == 32
            assert last.num_output_tokens == 3 and last.num_prompt_tokens == 40
        assert server.connections == 1 and conn.pool.connects == 1
        assert not lost and not conn.flights
        body = server.bodies[0]
        assert body["prompt"] == list(range(40)) and body["stream"] is True
        assert body["return_token_ids"] is True and body["request_id"] == "r0"
        # concurrent requests: one connection each, all kept for reuse
        await asyncio.gather(*(collect(conn, request(10 + i)) for i in range(4)))
        assert conn.pool.connects == 4
        conn.close()

    run(main())


def test_a_4xx_is_the_requests_fault_and_a_5xx_the_backends() -> None:
    async def handler(r: Any, w: asyncio.StreamWriter, body: dict[str, Any]) -> None:
        status = b"400 Bad Request" if body["request_id"] == "r0" else b"500 Internal Error"
        msg = json.dumps({"error": {"message": f"nope {body['request_id']}"}}).encode()
        w.write(b"HTTP/1.1 %s\r\ncontent-length: %d\r\n\r\n%s" % (status, len(msg), msg))

    async def main() -> None:
        server, conn, lost = await connection(handler)
        deltas = await collect(conn, request(0))
        assert deltas[-1].failure == "invalid" and deltas[-1].error == "nope r0"
        with pytest.raises(ReplicaDeadError, match="HTTP 500 nope r1"):
            await collect(conn, request(1))
        assert not lost and server.connections == 1  # both answers whole: kept alive
        conn.close()

    run(main())


def test_a_stream_cut_mid_response_loses_the_backend() -> None:
    async def handler(r: Any, w: asyncio.StreamWriter, body: dict[str, Any]) -> None:
        w.write(HEAD + chunked(sse())[:300])
        await w.drain()
        w.transport.abort()  # as a killed process: the connection just ends

    async def main() -> None:
        _, conn, lost = await connection(handler)
        with pytest.raises(ReplicaLostError):
            await collect(conn, request(0))
        assert conn.lost is not None and "stream broke" in conn.lost and lost

    run(main())


def test_a_response_without_done_loses_the_backend() -> None:
    async def handler(r: Any, w: asyncio.StreamWriter, body: dict[str, Any]) -> None:
        w.write(HEAD + chunked(sse()[:1]))

    async def main() -> None:
        _, conn, lost = await connection(handler)
        with pytest.raises(ReplicaLostError):
            await collect(conn, request(0))
        assert conn.lost == "its response ended early" and lost

    run(main())


def test_an_unreachable_backend_is_lost_and_nobodys_fault() -> None:
    async def main() -> None:
        server, conn, lost = await connection(whole)
        server.server.close()
        await server.server.wait_closed()
        with pytest.raises(ReplicaLostError) as info:
            await collect(conn, request(0))
        assert "unreachable" in str(info.value) and not info.value.maybe_cause
        assert lost

    run(main())


def test_a_malformed_line_fails_the_request_and_drops_its_connection() -> None:
    async def handler(r: Any, w: asyncio.StreamWriter, body: dict[str, Any]) -> None:
        w.write(HEAD + chunked([b"data: {not json\n\n"]))

    async def main() -> None:
        _, conn, lost = await connection(handler)
        with pytest.raises(ReplicaDeadError):
            await collect(conn, request(0))
        assert conn.malformed == 1 and not lost

    run(main())


def test_a_server_closing_an_idle_kept_alive_connection_is_no_failure() -> None:
    async def handler(r: Any, w: asyncio.StreamWriter, body: dict[str, Any]) -> None:
        w.write(HEAD + chunked(sse()))
        await w.drain()
        w.close()  # as uvicorn's keep-alive timeout: closed once idle

    async def main() -> None:
        server, conn, lost = await connection(handler)
        for i in range(3):
            await collect(conn, request(i))
            await asyncio.sleep(0.05)
        assert not lost and server.connections == 3
        conn.close()

    run(main())


def test_an_abort_closes_the_backends_connection() -> None:
    async def handler(r: Any, w: asyncio.StreamWriter, body: dict[str, Any]) -> None:
        w.write(HEAD + chunked(sse()[:1])[:-5])  # the first token, then nothing more
        await w.drain()
        await r.read()  # until the router closes it

    async def main() -> None:
        server, conn, lost = await connection(handler)
        flight = conn.submit(request(0))
        first = await asyncio.wait_for(flight.next(), 10)
        assert first.delta_token_ids == [100] and first.replica_ttft_s is not None
        conn.abort("r0")
        await asyncio.wait_for(server.closed.wait(), 10)  # vLLM sees the disconnect
        assert not lost and not conn.flights

    run(main())


def test_a_backends_control_calls_read_whole_bodies_over_one_kept_alive_connection() -> None:
    """``info``/``load``/``health`` (the fleet monitor's calls) over :mod:`.wire`'s pool:
    /metrics chunked across writes, /v1/models by content-length, one connection reused; a
    5xx is a :class:`BackendError`, a backend that does not answer a ``TimeoutError``."""
    from kvroute.router.backends.control import BackendError, BackendSpec, HttpBackend

    metrics = (
        b"# HELP process_start_time_seconds Start time.\n"
        b"process_start_time_seconds 1.5e+09\n"
        b'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        b'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0\n'
        b'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
        b'vllm:cache_config_info{block_size="32",enable_prefix_caching="True",'
        b'num_gpu_blocks="100",prefix_caching_hash_algo="sha256_cbor"} 1.0\n'
    ) + b"# filler\n" * 5000
    models = json.dumps({"data": [{"id": "m", "root": "/nowhere/m", "max_model_len": 64}]})
    seen: list[str] = []
    connections = [0]
    health = [200]

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        connections[0] += 1
        try:
            while True:
                head = (await r.readuntil(b"\r\n\r\n")).decode()
                path = head.split(" ")[1]
                seen.append(path)
                if path == "/metrics":
                    data = HEAD + chunked(
                        [metrics[i : i + 999] for i in range(0, len(metrics), 999)]
                    )
                    for i in range(0, len(data), 4096):
                        w.write(data[i : i + 4096])
                        await w.drain()
                elif path == "/v1/models":
                    w.write(
                        b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s"
                        % (len(models), models.encode())
                    )
                elif path == "/health" and health[0] == 200:
                    w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                elif path == "/health" and health[0] == 0:
                    await asyncio.sleep(60)  # hangs
                else:
                    w.write(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 4\r\n\r\noops")
                await w.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            w.close()

    async def main() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        spec = BackendSpec.parse(f"http://127.0.0.1:{port}=tcp://127.0.0.1:2")
        info: Any = type("I", (), {"block_size": 32, "topic": "kv", "incarnation": "x@0"})()
        backend = HttpBackend(spec, info, block_size=32, min_load_interval_s=0.0, timeout_s=0.5)
        got = await backend.info.remote()
        assert got.incarnation == f"127.0.0.1:{port}@1.5e+09" and got.num_blocks == 100
        assert got.model == "m" and got.max_model_len == 64
        report = await backend.load.remote()
        assert (report.num_running, report.num_waiting, report.free_blocks) == (3, 1, 50)
        await backend.health.remote()
        assert seen == ["/metrics", "/v1/models", "/metrics", "/health"]
        assert connections[0] == 1  # kept alive, reused
        health[0] = 500
        with pytest.raises(BackendError, match="HTTP 500"):
            await backend.health.remote()
        health[0] = 0
        with pytest.raises(TimeoutError):
            await backend.health.remote()
        health[0] = 200
        await backend.health.remote()  # a fresh connection after the hung one was closed
        await backend.aclose()
        server.close()

    run(main())
