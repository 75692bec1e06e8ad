"""The floor ``frontdoor_capacity.py`` measures kvroute's front door against.

Split out of ``benchmarks/frontdoor_capacity.py`` (the harness, whose docstring says what
the floor is for): a bare ASGI app under uvicorn that relays ``POST /v1/completions``
(token-id prompts) over the data plane to the replicas ``kvroute serve`` started, and
nothing else. The script starts it as ``python benchmarks/frontdoor_capacity.py
--floor-server --port P --fleet-url URL``, unchanged.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from typing import Any

__all__ = ["MODEL", "floor_server"]

MODEL = "sim:h100-8b"  # what every run serves (the floor's /v1/models names it too)


def floor_server(port: int, fleet_url: str) -> None:
    import itertools

    import msgspec
    import uvicorn

    from kvroute.events.replica_api import GenerateRequest, SamplingParams
    from kvroute.router.fleet.replica_connection import ReplicaConnection

    class Body(msgspec.Struct):
        prompt: list[int]
        max_tokens: int = 16
        temperature: float = 1.0
        ignore_eos: bool = False

    decode = msgspec.json.Decoder(Body).decode
    enc = msgspec.json.Encoder().encode
    ids = itertools.count()
    conns: list[Any] = []
    rr: list[Any] = [None]
    head = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
    models = b'{"object":"list","data":[{"id":"' + MODEL.encode() + b'","object":"model"}]}'

    def lost(rid: str, why: str) -> None:
        print(f"floor: replica {rid} lost ({why})", file=sys.stderr, flush=True)
        conns[:] = [c for c in conns if c.lost is None]
        rr[0] = itertools.cycle(conns) if conns else None

    async def reply(send: Any, status: int, body: bytes, ctype: bytes) -> None:
        await send(
            {"type": "http.response.start", "status": status, "headers": [(b"content-type", ctype)]}
        )
        await send({"type": "http.response.body", "body": body})

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    with urllib.request.urlopen(fleet_url + "/fleet", timeout=30) as r:
                        fleet = json.load(r)
                    for rep in fleet["replicas"]:
                        conns.append(
                            ReplicaConnection(
                                rep["replica_id"],
                                rep["data_endpoint"],
                                rep["incarnation"],
                                f"floor-{os.getpid()}",
                                lost,
                            )
                        )
                    rr[0] = itertools.cycle(conns)
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    for c in conns:
                        c.close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        arrival = time.perf_counter()
        if scope["method"] != "POST":
            if scope["path"] == "/v1/models":
                return await reply(send, 200, models, b"application/json")
            return await reply(send, 200 if scope["path"] == "/health" else 404, b"", b"text/plain")
        raw, more = b"", True
        while more:
            msg = await receive()
            raw += msg.get("body", b"")
            more = msg.get("more_body", False)
        body = decode(raw)
        if rr[0] is None:
            return await reply(send, 503, b"no replica", b"text/plain")
        conn = next(rr[0])
        req = GenerateRequest(
            request_id=f"floor-{next(ids)}",
            prompt_token_ids=body.prompt,
            sampling=SamplingParams(
                max_tokens=body.max_tokens, temperature=body.temperature, ignore_eos=body.ignore_eos
            ),
        )
        await send({"type": "http.response.start", "status": 200, "headers": head})
        msg = {"type": "http.response.body", "body": b"", "more_body": True}
        timing, last = b"", None
        try:
            async for d in conn.stream(req):
                if last is None and d.replica_ttft_s is not None:
                    timing = enc(
                        {
                            "replica_ttft_s": d.replica_ttft_s,
                            "router_ttft_s": time.perf_counter() - arrival,
                        }
                    )
                last = d
                if d.delta_text and not d.finished:  # the last delta goes with the tail
                    msg["body"] = b'data: {"choices":[{"text":' + enc(d.delta_text) + b"}]}\n\n"
                    await send(msg)
        except Exception as exc:  # the replica failed: say so, then [DONE]
            err = enc({"error": {"message": str(exc)}})
            msg.update(body=b"data: " + err + b"\n\ndata: [DONE]\n\n", more_body=False)
            return await send(msg)
        tail = b""
        if last is not None:  # the last chunk, the usage, the timing comment, [DONE]: one send
            fin = enc(last.finish_reason)
            tail = (
                b'data: {"choices":[{"text":'
                + enc(last.delta_text)
                + b',"finish_reason":'
                + fin
                + b"}]}\n\n"
                + b'data: {"choices":[],"usage":{"prompt_tokens":'
                + str(last.num_prompt_tokens).encode()
                + b',"completion_tokens":'
                + str(last.num_output_tokens).encode()
                + b"}}\n\n"
            )
        if timing:
            tail += b": kvroute-timing " + timing + b"\n\n"
        msg.update(body=tail + b"data: [DONE]\n\n", more_body=False)
        await send(msg)

    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        http="httptools",
        loop="uvloop",
        lifespan="on",
        log_level="warning",
        access_log=False,
    )
    uvicorn.Server(config).run()
