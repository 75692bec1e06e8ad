"""The pieces of P/D on vLLM replicas that need no engine (replica/vllm/disagg.py): the
connector's configuration, the handshake's environment, what a prefill half and a decode
half send vLLM, the handoff a prefill's last output makes, and ``kvroute serve``'s flags.

What it proves: only replicas with a role get NixlConnector (CPU buffer on a CPU, failed
pulls recomputed); two replicas on one host get different handshake ports; a prefill half
makes one token and carries :func:`vllm_prefill_params`, a decode half carries its source's
params unchanged; the handoff has no token and vLLM's params (none: the decode side runs it
whole); ``--engine vllm --prefill-replicas 1 --decode-replicas 1`` assigns the roles.
"""

from __future__ import annotations

import argparse
import os
from types import SimpleNamespace

import pytest

from kvroute.events.kv_transfer import KVSource, vllm_prefill_params
from kvroute.events.replica_api import SamplingParams
from kvroute.replica.vllm.adapt import LiveRequest, VllmEngineConfig
from kvroute.replica.vllm.disagg import (
    handoff_delta,
    kv_transfer_config,
    pd_params,
    prepare_side_channel,
    with_kv_transfer,
)

PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[1, 2, 3]],
    "remote_engine_id": "engine-p",
    "remote_request_id": "cmpl-1",
    "remote_host": "10.0.0.5",
    "remote_port": 5601,
    "tp_size": 1,
}


def test_only_a_role_gets_nixl() -> None:
    pytest.importorskip("vllm")
    assert kv_transfer_config("both", cpu=True) is None
    c = kv_transfer_config("prefill", cpu=True)
    assert (c.kv_connector, c.kv_role, c.kv_buffer_device) == ("NixlConnector", "kv_both", "cpu")
    assert c.kv_load_failure_policy == "recompute"
    assert kv_transfer_config("decode", cpu=False).kv_connector == "NixlConnector"
    with pytest.raises(ValueError, match="role"):
        kv_transfer_config("sideways", cpu=True)


def test_each_replica_gets_its_own_handshake_port(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("VLLM_NIXL_SIDE_CHANNEL_PORT", "VLLM_NIXL_SIDE_CHANNEL_HOST", "UCX_TLS"):
        monkeypatch.delenv(name, raising=False)
    a = prepare_side_channel("10.0.0.7", cpu=True)
    assert os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(a)
    assert os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.0.0.7"
    assert os.environ["UCX_TLS"] == "tcp,self,sm"
    b = prepare_side_channel("10.0.0.7", cpu=True)
    assert a != b or a > 0  # a fresh free port each time (the same one only if just freed)


def test_what_each_half_sends_vllm() -> None:
    p = SamplingParams(max_tokens=20, min_tokens=5, temperature=0.0, logprobs=2)
    first = pd_params(p, kv_handoff=True)
    assert (first.max_tokens, first.min_tokens, first.logprobs) == (1, 0, None)
    assert pd_params(p, kv_handoff=False) is p
    sampling = SimpleNamespace(extra_args=None)
    assert with_kv_transfer(sampling, True, None).extra_args == {
        "kv_transfer_params": vllm_prefill_params()
    }
    src = KVSource(replica_id="p0", endpoint="", lease=b"", num_blocks=3,
                   kv_transfer_params=PARAMS)  # fmt: skip
    sampling = SimpleNamespace(extra_args={"other": 1})
    out = with_kv_transfer(sampling, False, src).extra_args
    assert out == {"other": 1, "kv_transfer_params": PARAMS}
    plain = SimpleNamespace(extra_args=None)
    assert with_kv_transfer(plain, False, None).extra_args is None


def test_the_handoff_carries_vllms_params_and_no_token() -> None:
    live = LiveRequest("r1", sink=None, num_prompt=100)  # type: ignore[arg-type]
    d = handoff_delta(live, SimpleNamespace(kv_transfer_params=PARAMS, num_cached_tokens=64))
    assert (d.finished, d.finish_reason, d.delta_token_ids) == (True, "handoff", [])
    assert d.num_cached_tokens == 64 and d.num_prompt_tokens == 100
    assert d.kv_handoff is not None and d.kv_handoff.kv_transfer_params == PARAMS
    assert d.kv_handoff.num_blocks == 3 and d.kv_handoff.replica_id == "engine-p"
    assert KVSource.of(d.kv_handoff).kv_transfer_params == PARAMS
    none = handoff_delta(live, SimpleNamespace(kv_transfer_params=None, num_cached_tokens=0))
    assert none.kv_handoff is None and none.finish_reason == "handoff"


def test_a_vllm_config_takes_a_role() -> None:
    assert VllmEngineConfig.from_dict({"engine": "vllm", "role": "decode"}).role == "decode"
    assert VllmEngineConfig().role == "both"


def test_kvroute_serve_assigns_vllm_roles() -> None:
    pytest.importorskip("nixl")
    from kvroute.deploy.serve import _pd_roles

    args = argparse.Namespace(prefill_replicas=1, decode_replicas=2, engine="vllm",
                              max_replicas=None, model="tiny", replicas=None)  # fmt: skip
    assert _pd_roles(args) is None
    assert args.roles == ["prefill", "decode", "decode"] and args.replicas == 3
