"""Where kvroute's types meet vLLM's: a vLLM replica's settings and engine arguments,
sampling parameters in, data-plane deltas out.

Kept apart from :mod:`.vllm_engine` (the threads and the loop) so each stays readable, and
importable without vLLM: :func:`is_vllm_config` runs in every replica, vLLM's or not.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvroute.events.load import LoadReport
from kvroute.events.replica_api import (
    JSON_OBJECT_SCHEMA,
    GenerateDelta,
    SamplingParams,
    StructuredOutputs,
    next_delta,
)
from kvroute.events.translate import from_vllm_hash_algo

if TYPE_CHECKING:
    import asyncio

    from ..engine.replica_engine import OutputSink

HASH_ALGO = "sha256_cbor_tagged"  # vLLM 0.32's sha256_cbor, salt tagged (events/hashing.py)
VLLM_DEFAULT_SEED = "vllm-none-hash"  # vLLM's NONE_HASH seed for sha256* without PYTHONHASHSEED
CPU_KV_CACHE_BYTES = 1 << 30  # as kvroute's engine on CPU; vLLM's default takes 90% of RAM
_FINISH = {"stop": "stop", "length": "length", "abort": "abort", "error": "error"}
# What kvroute's routing depends on: engine_args may not change them. (It may change
# prefix_caching_hash_algo: one kvroute cannot reproduce is indexed by token ids.)
_FIXED = ("enable_prefix_caching", "kv_events_config")
VLLM_HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")  # vLLM 0.32's choices


@dataclass(slots=True)
class VllmEngineConfig:
    """What shapes a vLLM replica. ``engine_args``: any other ``AsyncEngineArgs`` field."""

    model: str = "smollm2-135m"  # a built-in name (kvroute builds the folder) or a HF folder
    block_size: int = 32  # vLLM's CPU attention wants a multiple of 32
    dtype: str | None = None  # None: float32 on CPU (as kvroute's engine), "auto" on GPU
    max_model_len: int | None = None
    kv_cache_memory_bytes: int | None = None  # None: 1 GiB on CPU; GPU: gpu_memory_utilization
    gpu_memory_utilization: float = 0.9
    num_blocks: int | None = None  # vLLM's num_gpu_blocks_override
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enforce_eager: bool | None = None  # None: True on CPU (torch.compile slows every start)
    device: str | None = None  # "cpu" (set by start_replica without GPUs) or None
    engine_args: dict[str, Any] = field(default_factory=dict)
    # LoRA adapters registered at start (name -> PEFT folder); vLLM's enable_lora, max_loras,
    # max_cpu_loras and max_lora_rank go in engine_args (enable_lora implied by these).
    lora_modules: dict[str, str] = field(default_factory=dict)
    engine: str = "vllm"  # the key that tells a replica which engine a config dict is for
    # P/D (replica/vllm/disagg.py): "prefill" or "decode" start vLLM with NixlConnector
    role: str = "both"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VllmEngineConfig:
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown vLLM replica settings: {', '.join(sorted(unknown))}")
        return cls(**d)


def is_vllm_config(config: object) -> bool:
    """Whether a replica's engine config asks for vLLM (a VllmEngineConfig or its dict)."""
    if isinstance(config, VllmEngineConfig):
        return True
    return isinstance(config, dict) and config.get("engine") == "vllm"


def engine_args(config: VllmEngineConfig, model_path: Path, cpu: bool, topic: str) -> Any:
    """vLLM's ``AsyncEngineArgs``: prefix caching with ``sha256_cbor`` (the hash kvroute
    reproduces) unless ``engine_args`` names another (then the router indexes its events by
    token ids), KV events on vLLM's ZMQ publisher with its replay socket, on free ports."""
    from vllm.config import KVEventsConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    c = config
    args: dict[str, Any] = {
        "model": str(model_path),
        "dtype": c.dtype or ("float32" if cpu else "auto"),
        "block_size": c.block_size,
        "enable_prefix_caching": True,
        "prefix_caching_hash_algo": "sha256_cbor",
        "enforce_eager": cpu if c.enforce_eager is None else c.enforce_eager,
        "gpu_memory_utilization": c.gpu_memory_utilization,
        "kv_events_config": KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint="tcp://*:0",  # vLLM binds a free port on VLLM_HOST_IP and says which
            replay_endpoint="tcp://*:0",
            topic=topic,
        ),
        "disable_log_stats": True,
        # One worker in the engine-core process: no third process per replica (and none
        # left behind when Ray kills the actor). engine_args may ask for "mp" or "ray".
        "distributed_executor_backend": "uni",
        # A request's priority (lower first, as kvroute's engine): vLLM refuses a nonzero one
        # under its default "fcfs"; with every request at 0 the order is still first come.
        "scheduling_policy": "priority",
    }
    if c.lora_modules:
        args["enable_lora"] = True
    for key, value in (
        ("max_model_len", c.max_model_len),
        ("kv_cache_memory_bytes", c.kv_cache_memory_bytes or (CPU_KV_CACHE_BYTES if cpu else None)),
        ("num_gpu_blocks_override", c.num_blocks),
        ("max_num_seqs", c.max_num_seqs),
        ("max_num_batched_tokens", c.max_num_batched_tokens),
    ):
        if value is not None:
            args[key] = value
    for key in _FIXED:
        if key in c.engine_args and c.engine_args[key] != args[key]:
            raise ValueError(
                f"engine_args may not change {key}: kvroute routes by vLLM's prefix cache "
                "and its KV events"
            )
    algo = c.engine_args.get("prefix_caching_hash_algo", args["prefix_caching_hash_algo"])
    if algo not in VLLM_HASH_ALGOS:
        raise ValueError(
            f"prefix_caching_hash_algo {algo!r}: expected one of {', '.join(VLLM_HASH_ALGOS)}"
        )
    return AsyncEngineArgs(**{**args, **c.engine_args})


def reported_hash_algo(vllm_algo: str) -> str:
    """The hash algorithm a vLLM replica reports: ``sha256_cbor_tagged`` for vLLM's
    ``sha256_cbor`` (kvroute reproduces it), else ``vllm:<algo>`` (indexed by token ids)."""
    return from_vllm_hash_algo(vllm_algo)


def prepare_environment(config: VllmEngineConfig, events_host: str) -> None:
    """Environment vLLM reads when it starts (its engine-core process inherits it), and
    the hook that hides broken torch companions in every Python process vLLM starts (with
    a cold model-info cache it inspects the model in ``python -m
    vllm.model_executor.models.registry``: kvroute.events.torch_wheels says why)."""
    from kvroute.events.torch_wheels import hide_in_subprocesses

    hide_in_subprocesses()
    if config.device == "cpu":
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        # Several replicas may share a host: vLLM's automatic core binding would pin them
        # all to the same cores. Threads come from OMP_NUM_THREADS (the replica's share).
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if events_host not in ("", "*", "0.0.0.0"):
        os.environ.setdefault("VLLM_HOST_IP", events_host)  # where `tcp://*:0` binds


def count_params(model_path: Path) -> int:
    """Parameters in a folder's safetensors, read from their headers (no weights loaded)."""
    total = 0
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                count = 1
                for d in meta["shape"]:
                    count *= d
                total += count
    return total


@dataclass(slots=True, eq=False)
class LiveRequest:
    """One request on its way through vLLM."""

    request_id: str
    sink: OutputSink
    num_prompt: int
    num_output: int = 0  # generated so far, resumed tokens included
    pending_text: str = ""  # a resumed request's text the client has not had yet
    logprobs: bool = False
    task: asyncio.Task[None] | None = None


def to_vllm_sampling(params: SamplingParams, done: int) -> Any:
    """kvroute's sampling parameters as vLLM's, deltas out; None: nothing left to make.
    ``done``: tokens already generated (a resumed request)."""
    from vllm import SamplingParams as VllmSampling
    from vllm.sampling_params import RequestOutputKind

    left = params.max_tokens - done
    if left <= 0:
        return None
    return VllmSampling(
        n=1,
        max_tokens=left,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,  # 0 disables top-k in both
        min_p=params.min_p,
        seed=params.seed,
        stop=list(params.stop) or None,
        stop_token_ids=list(params.stop_token_ids) or None,
        ignore_eos=params.ignore_eos,
        min_tokens=max(0, params.min_tokens - done),
        logprobs=params.logprobs,
        # All at once at the end of the prefill, with DELTA outputs. A resumed request's
        # client has them from its first replica.
        prompt_logprobs=params.prompt_logprobs if not done else None,
        # A resumed request's earlier tokens are its prompt here: they count for the
        # repetition penalty, not for the frequency and presence ones.
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        logit_bias=dict(params.logit_bias) if params.logit_bias else None,
        structured_outputs=to_vllm_structured(params.structured_outputs),
        output_kind=RequestOutputKind.DELTA,
    )


def to_vllm_structured(so: StructuredOutputs | None) -> Any:
    """kvroute's structured-output constraint as vLLM's (the same fields; any JSON object
    as the schema ``{"type": "object"}``, as kvroute's engine compiles it)."""
    if so is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    json_schema = JSON_OBJECT_SCHEMA if so.json_object else so.json
    return StructuredOutputsParams(
        json=json_schema,
        regex=so.regex,
        choice=list(so.choice) if so.choice is not None else None,
        grammar=so.grammar,
        disable_any_whitespace=so.disable_any_whitespace,
    )


def from_vllm_output(live: LiveRequest, out: Any) -> GenerateDelta:
    """One vLLM delta output (``RequestOutput``) as the data plane's GenerateDelta."""
    c = out.outputs[0] if out.outputs else None
    ids = list(c.token_ids) if c is not None else []
    reason = None
    if out.finished:
        raw = c.finish_reason if c is not None else "abort"
        reason = _FINISH.get(str(raw), "stop")  # vLLM's "repetition" ends it as a stop
    delta = next_delta(live, ids, c.text if c is not None else "", reason)
    delta.num_cached_tokens = min(out.num_cached_tokens or 0, live.num_prompt)
    if out.finished and c is not None:
        delta.stop_reason = c.stop_reason
    if live.logprobs and c is not None and c.logprobs is not None:
        delta.logprobs = [{t: float(lp.logprob) for t, lp in d.items()} for d in c.logprobs]
    if out.prompt_logprobs:
        delta.prompt_logprobs = [
            None if d is None else {t: float(lp.logprob) for t, lp in d.items()}
            for d in out.prompt_logprobs
        ]
    return delta


def idle_load(total: int) -> LoadReport:
    return LoadReport(
        num_waiting=0,
        num_running=0,
        num_decoding=0,
        queued_prefill_tokens=0,
        decode_context_tokens=0,
        free_blocks=total,
        total_blocks=total,
    )


def estimate_load(live: list[LiveRequest], total: int, block_size: int) -> LoadReport:
    """Without kvroute's vLLM plugin: this replica's own requests, those with output as
    running and decoding, the others as waiting (their prompt queued); sharing ignored."""
    waiting = [v for v in live if v.num_output == 0]
    decoding = [v for v in live if v.num_output > 0]
    used = sum(-(-(v.num_prompt + v.num_output) // block_size) for v in live)
    return LoadReport(
        num_waiting=len(waiting),
        num_running=len(decoding),
        num_decoding=len(decoding),
        queued_prefill_tokens=sum(v.num_prompt for v in waiting),
        decode_context_tokens=sum(v.num_prompt + v.num_output for v in decoding),
        free_blocks=max(0, total - used),
        total_blocks=total,
    )
