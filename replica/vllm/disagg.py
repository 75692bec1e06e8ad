"""P/D on vLLM replicas (``kvroute serve --engine vllm --prefill-replicas N
--decode-replicas M``): vLLM's own NixlConnector moves the KV, and the front door's two-phase
run (:mod:`kvroute.router.fleet.request_run`) carries vLLM's ``kv_transfer_params`` between
the two replicas, as vLLM's P/D proxy and llm-d's sidecar carry them between two ``vllm
serve`` (:mod:`kvroute.router.backends.pd` does that for external ones).

How it maps onto kvroute's handoff:
- A replica with a role (prefill or decode) starts vLLM with ``kv_transfer_config``
  NixlConnector, ``kv_role`` ``kv_both``, and on a CPU ``kv_buffer_device`` ``cpu`` (vLLM PR
  #28356), and ``kv_load_failure_policy`` ``recompute``: a pull that fails costs time, not the
  request. Its NIXL handshake listens on ``VLLM_NIXL_SIDE_CHANNEL_HOST:PORT``: the node's
  address and a free port picked here (vLLM's default port, 5600, would collide between
  replicas on one host); UCX over TCP on a CPU.
- A ``kv_handoff`` request (its prefill half) runs with ``max_tokens`` 1 and
  :func:`~kvroute.events.kv_transfer.vllm_prefill_params` in ``extra_args`` (vLLM's OpenAI
  server puts a request's ``kv_transfer_params`` there); its last output's
  ``kv_transfer_params`` end it as a handoff without a token (the decode side recomputes
  the last prompt token and makes the first one, as with any vLLM P/D proxy).
- A request with a ``kv_source`` that carries vLLM's params (its decode half) runs with them
  in ``extra_args``: vLLM's scheduler pulls the blocks it does not hold before it runs.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import msgspec

from kvroute.events.kv_transfer import KVSource, vllm_handoff, vllm_prefill_params
from kvroute.events.replica_api import GenerateDelta, SamplingParams

from .adapt import LiveRequest

ROLES = ("prefill", "decode", "both")


def kv_transfer_config(role: str, cpu: bool) -> Any:
    """vLLM's ``KVTransferConfig`` for a replica with a role; None for ``both``."""
    if role not in ROLES:
        raise ValueError(f"role {role!r}: expected one of {', '.join(ROLES)}")
    if role == "both":
        return None
    from vllm.config import KVTransferConfig

    extra = {"kv_buffer_device": "cpu"} if cpu else {}
    # A pull that fails recomputes the blocks (vLLM 0.32's default fails the request).
    return KVTransferConfig(
        kv_connector="NixlConnector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        **extra,
    )


def prepare_side_channel(host: str, cpu: bool) -> int:
    """The environment NixlConnector reads at start (the engine-core process inherits it):
    a free port of this host for its handshake listener, the address peers dial; UCX over
    TCP on a CPU. Returns the port."""
    with socket.socket() as s:
        s.bind(("", 0))
        port = int(s.getsockname()[1])
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
    if host not in ("", "*", "0.0.0.0"):
        os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = host
    if cpu:
        os.environ.setdefault("UCX_TLS", "tcp,self,sm")
    return port


def pd_params(params: SamplingParams, kv_handoff: bool) -> SamplingParams:
    """A prefill half makes one token (vLLM's proxies drop ``min_tokens`` too)."""
    if not kv_handoff:
        return params
    return msgspec.structs.replace(params, max_tokens=1, min_tokens=0, logprobs=None)


def with_kv_transfer(sampling: Any, kv_handoff: bool, kv_source: KVSource | None) -> Any:
    """vLLM's sampling parameters with the request's ``kv_transfer_params`` (in
    ``extra_args``, where vLLM's scheduler and connector read them)."""
    if kv_handoff:
        params: dict[str, Any] | None = vllm_prefill_params()
    elif kv_source is not None and kv_source.kv_transfer_params:
        params = dict(kv_source.kv_transfer_params)
    else:
        return sampling
    sampling.extra_args = {**(sampling.extra_args or {}), "kv_transfer_params": params}
    return sampling


def handoff_delta(live: LiveRequest, out: Any) -> GenerateDelta:
    """The prefill half's end: no token (the decode side makes it), vLLM's params in a
    :class:`~kvroute.events.kv_transfer.KVHandoff` (none: the decode side runs it whole)."""
    params = getattr(out, "kv_transfer_params", None)
    engine = str((params or {}).get("remote_engine_id") or "")
    return GenerateDelta(
        request_id=live.request_id,
        delta_token_ids=[],
        finished=True,
        finish_reason="handoff",
        num_prompt_tokens=live.num_prompt,
        num_cached_tokens=min(getattr(out, "num_cached_tokens", 0) or 0, live.num_prompt),
        kv_handoff=vllm_handoff(engine, params),
    )
