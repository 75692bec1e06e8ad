"""The completion endpoints' per-request path in the front door, piece by piece, in process.

    python benchmarks/bench_hot_lane.py [--n 20000]

Times what a request pays in the front door's event loop outside routing and the data
plane, each piece many times on one loop (uvloop where installed), so that the figures hold
on a busy machine where a whole-server benchmark cannot resolve tens of microseconds:

- ``lane``: the endpoint's direct ASGI app (``app.direct_endpoints[...]``, ``app.hot`` in
  older trees: request id, status counter, send deadline, authentication, error mapping)
  around a handler that reads a 512-id body
  (``read_body``) and answers with a one-chunk SSE response (its head through the lane,
  the chunk on the raw send); no sockets (``send`` and ``receive`` are stubs);
- ``ids``: the two random ids a request gets (request id, response id);
- ``check_ids``: the bound on a validated 512-id prompt against the vocabulary;
- ``writes``: a response head and its first chunk on a loopback TCP socket, as two writes
  and as one (what the cycle's transport now does: ``deploy/http_server.py``).

Run it from each tree to compare (``PYTHONPATH`` picks which kvroute is imported); pieces
a tree does not have are skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import time
import uuid
from collections import Counter
from types import SimpleNamespace
from typing import Any

import msgspec


def best_of(fn: Any, n: int, repeat: int = 5) -> float:
    """CPU us per call (this thread's), the best of ``repeat`` runs of ``n`` calls."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.thread_time()
        fn(n)
        best = min(best, (time.thread_time() - t0) / n)
    return best * 1e6


def lane_us(n: int) -> float:
    from kvroute.router.api import app as http_api
    from kvroute.router.api.errors import read_body
    from kvroute.router.api.metrics import Metrics
    from kvroute.router.api.sse import SSEResponse
    from kvroute.router.fleet.tenants import Tenants

    async def handler(request: Any, tenant: Any) -> Any:
        await read_body(request, 1 << 20, 30.0)

        async def write(emit: Any) -> None:
            await emit(b'data: {"choices":[]}\n\ndata: [DONE]\n\n', True)

        return SSEResponse(write, {"x-kvroute-replica": "r0"}, 60.0, on_close=lambda: None)

    door = SimpleNamespace(  # what create_app reads of a front door (older trees: less)
        fleet=SimpleNamespace(model="m", replicas={}),
        tokenizer=None,
        metrics=Metrics(),
        errors=Counter(),
        admission=None,
        run=None,
        fleet_collector=None,
        add_error_counts=lambda counts: None,
        loras=None,
    )
    saved = http_api.completions
    http_api.completions = handler  # the lane wraps what the module names at create_app
    try:
        app = http_api.create_app(door, Tenants(None, "secret"))  # type: ignore[arg-type]
    finally:
        http_api.completions = saved
    direct = getattr(app, "direct_endpoints", None) or app.hot  # its name in older trees
    lane = direct["/v1/completions"]
    body = msgspec.json.encode({"model": "m", "prompt": list(range(1000, 1512)), "max_tokens": 4})
    headers = [
        (b"host", b"127.0.0.1:8000"),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"authorization", b"Bearer x"),
    ]

    async def run(n: int) -> None:
        loop = asyncio.get_running_loop()
        sent = 0

        async def send(message: Any) -> None:
            nonlocal sent
            sent += 1

        for _ in range(n):
            first = True
            never = loop.create_future()

            async def receive(never: asyncio.Future[Any] = never) -> Any:
                nonlocal first
                if first:
                    first = False
                    return {"type": "http.request", "body": body, "more_body": False}
                return await never

            scope = {
                "type": "http",
                "method": "POST",
                "path": "/v1/completions",
                "headers": headers,
                "app": app,
                "kvroute.raw_send": send,
            }
            await lane(scope, receive, send)
        assert sent == 2 * n, sent

    loop = _loop()
    try:
        return best_of(lambda k: loop.run_until_complete(run(k)), n)
    finally:
        loop.close()


def ids_us(n: int) -> tuple[float, float]:
    def uuids(k: int) -> None:
        for _ in range(k):
            f"req-{uuid.uuid4().hex}"
            f"cmpl-{uuid.uuid4().hex}"

    try:
        from kvroute.router.api.errors import new_id
    except ImportError:
        return best_of(uuids, n), float("nan")

    def ours(k: int) -> None:
        for _ in range(k):
            f"req-{new_id()}"
            f"cmpl-{new_id()}"

    return best_of(uuids, n), best_of(ours, n)


def check_ids_us(n: int) -> float:
    import inspect

    from kvroute.router.api.intake import Intake

    info = SimpleNamespace(vocab_size=128_256)
    replicas = {f"r{i}": SimpleNamespace(info=info) for i in range(2)}
    fleet = SimpleNamespace(replicas=replicas, vocab_size=lambda: info.vocab_size)
    intake: Any = Intake.__new__(Intake)
    intake.door = SimpleNamespace(fleet=fleet)  # older trees read the fleet through it
    intake.served = fleet
    check = getattr(intake, "check_ids", None) or intake._check_ids  # its older name
    ids = list(range(1000, 1512))
    validated = "validated" in inspect.signature(check).parameters

    def run(k: int) -> None:
        for _ in range(k):
            if validated:
                check(ids, validated=True)
            else:
                check(ids)

    return best_of(run, n)


def writes_us(n: int) -> tuple[float, float]:
    """CPU us per response for a 180-byte head and a 120-byte chunk to a reader blocked in
    another process (as a client is: each write wakes it), as two sends, then as one."""
    server = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(server.getsockname())
    a.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    b, _ = server.accept()
    pid = os.fork()
    if pid == 0:  # the reader: drains until the writer closes
        a.close()
        while os.read(b.fileno(), 1 << 16):
            pass
        os._exit(0)
    b.close()
    head, chunk = b"h" * 180, b"c" * 120

    def two(k: int) -> None:
        for _ in range(k):
            a.send(head)
            a.send(chunk)
            time.sleep(0)

    def one(k: int) -> None:
        for _ in range(k):
            a.send(head + chunk)
            time.sleep(0)

    def cpu(fn: Any) -> float:
        best = float("inf")
        for _ in range(5):
            t0 = time.thread_time()
            fn(n)
            best = min(best, (time.thread_time() - t0) / n)
        return best * 1e6

    try:
        return cpu(two), cpu(one)
    finally:
        a.close()
        server.close()
        os.waitpid(pid, 0)


def _loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()  # type: ignore[no-any-return]
    except ImportError:
        return asyncio.new_event_loop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20000, help="calls per timed run")
    args = ap.parse_args()
    import kvroute.router

    print(f"kvroute from {kvroute.router.__file__}")
    print(f"lane (read 512-id body, SSE head + one chunk): {lane_us(args.n // 4):.1f} us/request")
    old, new = ids_us(args.n)
    print(f"ids: uuid4 x2 {old:.2f} us, new_id x2 {new:.2f} us")
    print(f"check_ids (512 validated ids): {check_ids_us(args.n):.2f} us")
    two, one = writes_us(args.n)
    print(f"loopback writes per response: head + chunk apart {two:.2f} us, together {one:.2f} us")


if __name__ == "__main__":
    main()
