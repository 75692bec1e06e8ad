"""An engine's configuration, and the parts built from it before the first step: the model
folder, tokenizer and runner (a torch model, or the cost model of a ``sim:`` replica, which
imports no torch), the lower KV tiers, the EOS ids. Apart from :mod:`.engine` so that the
step code reads without the start-up code."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from kvroute.events import DEFAULT_SEED
from kvroute.events.hashing import HashForm
from kvroute.events.kv_transfer import DEFAULT_LEASE_S

from ..core.kv_cache_manager import KVCacheManager
from ..model.cost_model import sim_profile
from ..model.models import resolve_model

if TYPE_CHECKING:  # torch: a cost-model replica never imports it
    from ..kv_tiers.tiers import KVTiers
    from ..kv_transfer.fetcher import KVLink


@dataclass
class EngineConfig:
    """Everything that shapes one engine. Defaults suit the CPU and the built-in models."""

    model: str = "tiny"
    block_size: int = 16
    num_blocks: int | None = None  # None: as many as kv_cache_memory_bytes holds
    kv_cache_memory_bytes: int | None = None  # None: 1 GiB on CPU; on CUDA see below
    gpu_memory_utilization: float = 0.9  # CUDA: share of the card weights + KV may use
    max_num_batched_tokens: int | None = None  # None: 2048; a cost-model profile's own
    max_num_seqs: int | None = None  # None: 128; a cost-model profile's own
    max_model_len: int | None = None  # None: the model's max positions, capped by the cache
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # >0: at most this many prompt tokens of one request per step, so steps stay short
    # and a newcomer's first token waits for one short step (a TTFT-for-throughput knob,
    # as vLLM's long_prefill_token_threshold)
    long_prefill_token_threshold: int = 0
    # >0: at most this many requests of one tenant part-way through their prompt at once
    # (vLLM's max_num_partial_prefills, per tenant); with the threshold, it bounds a step
    max_num_partial_prefills: int = 0
    hash_algo: str = "xxh3_128"
    hash_seed: str = DEFAULT_SEED
    hash_form: HashForm = "bytes"
    dtype: str | None = None  # "float32", "bfloat16", ... None: bf16 on CUDA, fp32 on CPU
    device: str | None = None
    seed: int = 0
    # "kvroute": own decoder (Llama, Mistral, Qwen2, Qwen3, Gemma3); "transformers": transformers'
    # modules over the paged kernels; "auto": the first where it applies (model_runner)
    model_impl: str = "auto"
    # CUDA: decode batches run eager instead of replaying captured graphs (cuda_graphs)
    enforce_eager: bool = False
    stream_text: bool = True  # detokenize every step (streaming); False: once at the end
    # ``model="sim:<profile>"`` (a cost-model replica, see cost_model_runner): wall seconds
    # per modelled second of every step.
    time_scale: float = 1.0
    # LoRA adapters (vLLM's --enable-lora and friends; replica/model/lora_store.py). On with
    # enable_lora or any lora_modules; a request names its adapter (lora_name).
    enable_lora: bool = False
    max_loras: int = 1  # adapters in device slots: one step mixes at most this many
    max_cpu_loras: int | None = None  # adapters kept in host memory; None: max_loras
    max_lora_rank: int = 16  # the largest adapter rank accepted
    lora_modules: dict[str, str] = field(default_factory=dict)  # name -> PEFT folder, at start
    # Lower KV tiers (replica/kv_tiers/tiers.py): blocks the device cache evicts live on in host
    # memory (this many bytes; 0: none) and past it on local disk (a folder, wiped at start,
    # and its bytes; None/0: none), and are loaded back instead of recomputed.
    kv_host_bytes: int = 0
    kv_disk_path: str | None = None
    kv_disk_bytes: int = 0
    # The disk folder holds tenants' prompts in KV form: private to this user (0700, files
    # 0600) always, and with kv_disk_encrypt its blocks are sealed too (AES-GCM, a key in
    # memory only; replica/kv_tiers/seal.py). A disk read that does not answer within
    # kv_disk_read_timeout_s is recomputed (replica/kv_tiers/disk_reads.py).
    kv_disk_encrypt: bool = False
    kv_disk_read_timeout_s: float = 2.0
    # KV between replicas (replica/kv_transfer/): a request with kv_handoff ends after its first
    # token, its prompt blocks leased for kv_lease_s to the replica that decodes it; one with
    # a kv_source pulls them from there. replica_id: who this engine is to other replicas
    # (None: a random id). Without a kv_link given, the blocks go over ZeroMQ TCP: the
    # engine serves its leases at kv_transfer_bind (replica/kv_transfer/plane.py; a port of
    # * is picked by the OS) and pulls through a PlaneLink.
    kv_transfer: bool = False
    kv_transfer_bind: str = "tcp://127.0.0.1:*"
    kv_lease_s: float = DEFAULT_LEASE_S
    # The link's bytes/s to other replicas as the operator knows it (0: unknown): reported
    # in the load report, and the pulls' deadline, until pulls have measured it.
    kv_link_bytes_per_s: float = 0.0
    replica_id: str | None = None
    # Its P/D role (ReplicaInfo.role): "prefill", "decode" or "both"; any but "both" turns
    # kv_transfer on (see __post_init__).
    role: str = "both"

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode", "both"):
            raise ValueError(f"role must be prefill, decode or both, got {self.role!r}")
        if self.role != "both":
            self.kv_transfer = True

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)


def build_kv_tiers(
    config: EngineConfig, runner: Any, kv: KVCacheManager, link: KVLink | None = None
) -> KVTiers | None:
    """The host/disk tiers under the device pool, when asked for and there is a KV cache
    to copy (a cost-model replica has none); with kv_transfer, the tiers' loader also lands
    the blocks pulled over ``link`` from other replicas."""
    if not (config.kv_host_bytes or config.kv_disk_path or config.kv_transfer):
        return None
    what = "kv_transfer" if config.kv_transfer else "kv_host_bytes / kv_disk_path"
    if not hasattr(runner, "kv_caches"):
        raise ValueError(f"{what} need a model; this replica is a cost model")
    if not config.enable_prefix_caching:
        raise ValueError(f"{what} need prefix caching")
    from ..kv_tiers.tiers import KVTiers

    tiers = KVTiers(
        runner.kv_caches,
        host_bytes=config.kv_host_bytes,
        disk_path=config.kv_disk_path,
        disk_bytes=config.kv_disk_bytes,
        disk_encrypt=config.kv_disk_encrypt,
        disk_read_timeout_s=config.kv_disk_read_timeout_s,
        link=link if config.kv_transfer else None,
    )
    tiers.attach(kv.block_pool)
    if tiers.remote is not None and config.kv_link_bytes_per_s > 0:
        tiers.remote.bytes_per_s = config.kv_link_bytes_per_s  # the pulls' mean starts there
    return tiers


def build_runner(config: EngineConfig) -> tuple[Path, Any, Any]:
    """(model folder, tokenizer, runner). A ``sim:`` model is the cost model behind the
    built-in byte tokenizer; it imports no torch, so dozens fit on one small machine."""
    profile = sim_profile(config.model)
    if profile is not None:
        from transformers import PreTrainedTokenizerFast  # AutoTokenizer would import torch

        from ..model.cost_model_runner import CostModelRunner

        path = resolve_model("tiny")
        runner: Any = CostModelRunner(
            profile,
            block_size=config.block_size,
            num_blocks=config.num_blocks,
            time_scale=config.time_scale,
        )
        return path, PreTrainedTokenizerFast.from_pretrained(path), runner
    import torch
    from transformers import AutoTokenizer

    from ..model.model_runner import ModelRunner

    path = resolve_model(config.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    runner = ModelRunner(
        path,
        block_size=config.block_size,
        num_blocks=config.num_blocks,
        kv_cache_memory_bytes=config.kv_cache_memory_bytes,
        gpu_memory_utilization=config.gpu_memory_utilization,
        dtype=getattr(torch, config.dtype) if config.dtype else None,
        device=config.device,
        seed=config.seed,
        model_impl=config.model_impl,
    )
    return path, tokenizer, runner


def eos_token_ids(path: Path, tokenizer: Any) -> tuple[int | None, list[int]]:
    """The tokenizer's EOS, and any other EOS ids the model's generation config names."""
    primary = tokenizer.eos_token_id
    # Read as JSON: transformers' GenerationConfig imports torch in some versions (5.19),
    # which a cost-model replica must not load.
    try:
        gen_eos = msgspec.json.decode((path / "generation_config.json").read_bytes()).get(
            "eos_token_id"
        )
    except (OSError, msgspec.DecodeError, AttributeError):  # absent or not a JSON object
        gen_eos = None
    ids = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
    if primary is None and ids:
        primary = ids[0]
    return primary, [i for i in ids if i != primary]
