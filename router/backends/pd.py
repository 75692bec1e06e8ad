"""The prefill half of a P/D pair of ``vllm serve`` backends, over vLLM's own
``kv_transfer_params`` protocol (its NixlConnector moves the KV between the two engines).

What is sent, as vLLM's P/D proxy (``tests/v1/kv_connector/nixl_integration/
toy_proxy_server.py``) and llm-d's routing sidecar (``connector_nixlv2.go``) send it:
- to the prefill backend, the request with ``kv_transfer_params``
  (:func:`~kvroute.events.kv_transfer.vllm_prefill_params`: ``do_remote_decode`` true),
  ``max_tokens`` 1, no stream, no ``min_tokens``;
- its answer's top-level ``kv_transfer_params`` (vLLM 0.32's NixlConnector returns
  ``do_remote_prefill``, ``remote_block_ids``, ``remote_engine_id``, ``remote_request_id``,
  ``remote_host``, ``remote_port``, ``tp_size``, ``remote_num_tokens``, ...) go with the
  decode request, as they are (:func:`kvroute.router.backends.connection.completion_body`);
  the prefill's token is dropped: the decode engine recomputes the last prompt token and
  makes the first token itself, and its stream is the client's.

Here that is one handoff delta (``finish_reason="handoff"``, no token, a
:class:`~kvroute.events.kv_transfer.KVHandoff` carrying the params), so the front door's
two-phase run (:mod:`kvroute.router.fleet.request_run`) routes the rest among the decode
backends by its policy, as it does for kvroute's own engines.

Failures: a prefill backend that cannot be reached, answers 5xx, breaks its response or
answers without ``kv_transfer_params`` (no connector) costs the request nothing: the handoff
carries no params, and the decode backend runs the request whole. A 4xx is the request's
own fault (vLLM's message, as for any request).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import msgspec

from kvroute.events.kv_transfer import vllm_handoff, vllm_prefill_params
from kvroute.events.replica_api import GenerateDelta

from .wire import ConnectFailedError, StreamBrokenError

if TYPE_CHECKING:
    from ..fleet.replica_connection import InFlightRequest
    from .connection import HttpReplicaConnection

log = logging.getLogger(__name__)

# Fields a prefill with max_tokens 1 has no use for (vLLM's proxy drops min_tokens too).
_PREFILL_DROPS = ("stream_options", "min_tokens", "logprobs", "return_tokens_as_token_ids")


class _Answer(msgspec.Struct):
    """The only field of vLLM's non-streamed completion read here."""

    kv_transfer_params: dict[str, Any] | None = None


_decode_answer = msgspec.json.Decoder(_Answer).decode
_encode = msgspec.json.Encoder().encode


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The decode request's body as its prefill half: one token, no stream, the params
    that tell vLLM's connector to keep the blocks for a remote decode."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROPS}
    out["stream"] = False
    out["max_tokens"] = 1
    out["kv_transfer_params"] = vllm_prefill_params()
    return out


def handoff_delta(
    request_id: str, num_prompt: int, replica_id: str, params: dict[str, Any] | None
) -> GenerateDelta:
    """The delta that ends the prefill half: no token; the params (None: none came, the
    decode side runs the request whole)."""
    return GenerateDelta(
        request_id=request_id,
        delta_token_ids=[],
        finished=True,
        finish_reason="handoff",
        num_prompt_tokens=num_prompt,
        kv_handoff=vllm_handoff(replica_id, params),
    )


async def run_prefill(
    conn: HttpReplicaConnection, body: dict[str, Any], flight: InFlightRequest, num_prompt: int
) -> None:
    """Runs the prefill half on ``conn``'s backend and settles ``flight`` with the handoff
    (module docstring); counted in ``conn.pd_counts``."""
    rid = flight.request_id
    raw = _encode(prefill_body(body))
    data = conn.pool.head("POST", "/v1/completions", len(raw)) + raw
    lines: list[bytes] = []
    params: dict[str, Any] | None = None
    lost: str | None = None
    why = ""
    try:
        try:
            _, status, refused = await conn.pool.send(data, lambda line: lines.append(line))
        except ConnectFailedError as exc:
            lost = why = f"unreachable ({exc})"
        except StreamBrokenError as exc:
            lost = why = f"its prefill response broke ({exc})"
        else:
            if 400 <= status < 500:  # the request's own fault: as any request's 4xx
                conn._refused(flight, status, refused)
                return
            if status != 200:
                why = f"HTTP {status} {refused[:200].decode(errors='replace')}"
            else:
                try:
                    params = _decode_answer(b"".join(lines)).kv_transfer_params
                except msgspec.DecodeError as exc:
                    why = f"an answer that is not a completion ({exc})"
                else:
                    if not params:
                        why = "no kv_transfer_params (is it started with a KV connector?)"
        if params:
            conn.pd_counts["prefills"] += 1
        else:
            conn.pd_counts["prefill_fallbacks"] += 1
            log.warning(
                "request %s: prefill on %s failed: %s; the decode side runs it whole",
                rid, conn.replica_id, why,
            )  # fmt: skip
        if conn.flights.pop(rid, None) is not None:
            flight.put(handoff_delta(rid, num_prompt, conn.replica_id, params))
        if lost is not None:
            conn.mark_lost(lost)
    finally:
        if conn._tasks.get(rid) is asyncio.current_task():
            del conn._tasks[rid]
