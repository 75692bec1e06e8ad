"""A stand-in for ``vllm serve`` with a KV connector, as a real HTTP server: the side of
vLLM's OpenAI server that kvroute's P/D pairing talks to, so the pairing can be tested in
the fast suite (a real ``vllm serve`` pair takes minutes to start here; that test lives in
``test_pd_vllm_real.py``).

What it implements, as vLLM 0.32 does (``vllm/entrypoints/openai/completion``,
``vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py``):
- ``POST /v1/completions`` with a token-id prompt, streamed (SSE chunks with
  ``token_ids`` under ``return_token_ids``, a usage chunk under ``include_usage``, then
  ``[DONE]``) or not (one JSON body);
- a request whose ``kv_transfer_params`` say ``do_remote_decode``: the prefill half. It
  keeps the prompt's "KV" (here: its tokens, by request id) for a pull and answers with
  ``kv_transfer_params`` as NixlConnector's ``request_finished`` builds them
  (``do_remote_prefill`` true, ``remote_block_ids`` one list per KV-cache group,
  ``remote_engine_id``, ``remote_request_id``, ``remote_host``, ``remote_port``,
  ``tp_size``, ``remote_num_tokens``, ...);
- a request whose params say ``do_remote_prefill``: the decode half. It pulls the KV from
  ``remote_host:remote_port`` (here ``GET /kv/{remote_request_id}``, which frees it, as
  the prefill engine frees its blocks once read), checks that it is this prompt's, then
  generates as a whole request would;
- ``/v1/models``, ``/health`` and the ``/metrics`` lines kvroute reads.

The "model" is a fixed function of the context (:func:`next_token`): a decode that starts
from pulled KV must give what a whole run gives. ``fail`` makes the prefill half fail
(``"500"``: an HTTP 500; ``"400"``: vLLM's refusal of a bad request; ``"no-params"``: an
answer without ``kv_transfer_params``, as a server started without a connector gives).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from kvroute.replica.model.models import tiny_model_path

from ...serve_process import free_port
from ...waiting import wait_for

BLOCK_SIZE = 32


def next_token(ctx: list[int]) -> int:
    """Letters 'a'..'z' of the tiny model's byte tokenizer (id = byte + 3)."""
    return 100 + (sum(ctx[-4:]) * 7 + len(ctx)) % 26


def generate(prompt: list[int], n: int) -> list[int]:
    ctx = list(prompt)
    for _ in range(n):
        ctx.append(next_token(ctx))
    return ctx[len(prompt) :]


def text_of(ids: list[int]) -> str:
    return bytes(t - 3 for t in ids).decode()


@dataclass
class StandIn:
    """One stand-in server; ``requests``: the bodies it was sent, in order."""

    name: str
    port: int = field(default_factory=free_port)
    engine_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    requests: list[dict[str, Any]] = field(default_factory=list)
    held: dict[str, list[int]] = field(default_factory=dict)
    pulls: list[str] = field(default_factory=list)
    fail: str | None = None
    server: uvicorn.Server | None = None
    thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> StandIn:
        config = uvicorn.Config(
            app(self), host="127.0.0.1", port=self.port, log_level="warning", lifespan="off"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server is not None and self.server.started, 20, self.name)
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(10)


def app(s: StandIn) -> FastAPI:
    api = FastAPI()
    started = time.time()

    @api.get("/health")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("")

    @api.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": "tiny", "root": str(tiny_model_path()), "max_model_len": 2048}
        return {"object": "list", "data": [card]}

    @api.get("/metrics")
    async def metrics() -> PlainTextResponse:
        info = (
            f'block_size="{BLOCK_SIZE}",enable_prefix_caching="True",'
            'prefix_caching_hash_algo="sha256_cbor",num_gpu_blocks="512"'
        )
        return PlainTextResponse(
            f"vllm:cache_config_info{{{info}}} 1.0\n"
            f'vllm:num_requests_running{{engine="0"}} 0.0\n'
            f'vllm:num_requests_waiting{{engine="0"}} 0.0\n'
            f'vllm:kv_cache_usage_perc{{engine="0"}} 0.0\n'
            f"process_start_time_seconds {started}\n"
        )

    @api.get("/kv/{rid}")
    async def pull(rid: str) -> JSONResponse:
        tokens = s.held.pop(rid, None)
        if tokens is None:
            return JSONResponse({"error": "unknown or expired"}, status_code=404)
        return JSONResponse({"tokens": tokens})

    @api.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        s.requests.append(body)
        prompt = list(body["prompt"])
        rid = f"cmpl-{uuid.uuid4().hex[:16]}"
        params = body.get("kv_transfer_params") or {}
        out_params = None
        if params.get("do_remote_decode"):  # the prefill half
            if s.fail == "500":
                return JSONResponse({"error": {"message": "boom", "code": 500}}, status_code=500)
            if s.fail == "400":  # as vLLM refuses a request (its OpenAI error shape)
                err = {"message": "stand-in refuses this prompt", "type": "BadRequestError",
                       "param": None, "code": 400}  # fmt: skip
                return JSONResponse({"error": err}, status_code=400)
            if s.fail != "no-params":
                s.held[rid] = prompt
                n_blocks = -(-len(prompt) // BLOCK_SIZE)
                out_params = {
                    "do_remote_prefill": True,
                    "do_remote_decode": False,
                    "remote_block_ids": [list(range(1, n_blocks + 1))],
                    "remote_engine_id": s.engine_id,
                    "remote_request_id": rid,
                    "remote_host": "127.0.0.1",
                    "remote_port": s.port,
                    "tp_size": 1,
                    "remote_num_tokens": len(prompt),
                    "transfer_mode": "pull",
                }
        elif params.get("do_remote_prefill"):  # the decode half: pull, then generate
            url = f"http://{params['remote_host']}:{params['remote_port']}"
            async with httpx.AsyncClient() as client:
                r = await client.get(f"{url}/kv/{params['remote_request_id']}")
            if r.status_code != 200 or r.json()["tokens"] != prompt:
                return JSONResponse({"error": {"message": "KV load failed"}}, status_code=500)
            s.pulls.append(params["remote_request_id"])
        ids = generate(prompt, int(body.get("max_tokens") or 16))
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(ids),
            "total_tokens": len(prompt) + len(ids),
        }
        if not body.get("stream"):
            choice = {"index": 0, "text": text_of(ids), "finish_reason": "length"}
            if body.get("return_token_ids"):
                choice["token_ids"] = ids
            return {
                "id": rid,
                "object": "text_completion",
                "model": "tiny",
                "choices": [choice],
                "usage": usage,
                "kv_transfer_params": out_params,
            }

        async def stream() -> Any:
            for i, t in enumerate(ids):
                last = i == len(ids) - 1
                choice = {"index": 0, "text": text_of([t]), "token_ids": [t],
                          "finish_reason": "length" if last else None}  # fmt: skip
                yield f"data: {json.dumps({'id': rid, 'choices': [choice]})}\n\n"
                await asyncio.sleep(0.005)
            if (body.get("stream_options") or {}).get("include_usage"):
                yield f"data: {json.dumps({'id': rid, 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return api
