"""Step-time cost model of one replica: what it reports to routers, what the simulator runs.

One engine step runs a batch: prefill chunks and decode tokens together (chunked prefill,
as vLLM V1 schedules). Its time is a roofline plus a fixed per-step overhead::

    t = overhead + max(flops / peak_flops_eff, bytes / mem_bw_eff)

    flops = sum over scheduled requests of  n * 2 * params  +  attn * (n * p0 + n*(n-1)/2)
    bytes = weight_bytes  +  kv_bytes_per_token * sum over requests of (p0 + n)

where a request schedules ``n`` tokens starting at position ``p0`` (its computed, possibly
cached, tokens). ``2 * params`` FLOPs per token is the dense matmul cost (Kaplan et al.,
2020); ``attn = 4 * layers * heads * head_dim`` FLOPs per (query, key) pair is QK^T plus AV.
A decode step reads every weight once and each request's whole KV context; a prefill chunk
is compute-bound. Prefill of a long prompt is quadratic in its length through ``attn``.

Profile ``h100-8b``: Llama-3.1-8B in bf16 on one H100 SXM 80 GB.

- Model (Hugging Face ``meta-llama/Llama-3.1-8B`` config.json): 8.03e9 parameters, 32 layers,
  32 query heads, 8 KV heads, head dim 128 -> KV bytes per token = 2 (K, V) * 32 * 8 * 128 *
  2 bytes = 131,072 (128 KiB); weights 16.06 GB.
- GPU (NVIDIA H100 SXM datasheet): 989 TFLOPS dense bf16, 3.35 TB/s HBM3. Effective: 45% of
  peak FLOPs for prefill GEMMs, 75% of peak bandwidth for decode -- typical measured
  efficiencies; they give a 8,192-token prefill of ~0.34 s and a batch-1 decode step of
  ~8 ms (~125 tokens/s), in line with published vLLM single-H100 figures for 8B models.
- Overhead 1.5 ms per step (scheduler, sampling, launch with CUDA graphs).
- KV capacity: ``gpu_memory_utilization`` 0.9 of 80 GB = 72 GB, minus 16 GB weights and
  ~4 GB activations / CUDA graphs = ~53 GiB for KV -> 434,000 tokens, i.e. 848 blocks of 512
  tokens (``kv_tokens``); vLLM reports KV capacities of this order for 8B models on H100.
- Batching: ``max_num_batched_tokens`` 8192 and ``max_num_seqs`` 256, vLLM V1's defaults for
  its OpenAI server.
- Lower KV tiers: the host link is PCIe 5.0 x16 (64 GB/s a direction, datasheet), 75% of it
  effective for pinned block copies = 48 GB/s each way (``host_bandwidth``); a local NVMe
  4.0 drive reads 7 GB/s, 75% effective = 5.25 GB/s (``disk_bandwidth``). A block loaded
  from a tier takes ``kv_bytes_per_token`` per token over that bandwidth; a block evicted
  to the host tier takes as long the other way (the link is full duplex). Copies run beside
  the step's compute on their own stream; a step that moves more than its compute takes
  lasts as long as its copies (:meth:`CostModel.step_time`'s ``transfer_s``).

Profile ``a100-8b``: the same model on one A100 SXM 80 GB, the generation before (NVIDIA A100
datasheet: 312 TFLOPS dense bf16, 2,039 GB/s HBM2e), with the same efficiencies, overhead,
KV capacity (same 80 GB) and batching: prefill ~3.2x and decode ~1.6x slower than
``h100-8b``; its host link is PCIe 4.0 x16 (24 GB/s effective). Half of each is a mixed
fleet (``kvroute simulate --profile h100-8b,a100-8b``), where a router must send the faster
replicas proportionally more.

These are a model, not a measurement: the simulator compares policies on equal terms; its
absolute latencies are only as right as this profile.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from kvroute.events import MEDIUM_CPU, MEDIUM_STORAGE
from kvroute.events.load import CostCoefficients


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    params: float  # parameters (FLOPs per token = 2 * params)
    layers: int
    heads: int
    head_dim: int
    kv_bytes_per_token: int
    weight_bytes: float
    peak_flops: float  # effective FLOP/s
    mem_bw: float  # effective bytes/s
    overhead_s: float
    kv_tokens: int  # KV cache capacity in tokens
    max_batched_tokens: int = 8192
    max_num_seqs: int = 256
    vocab_size: int = 128_256  # Llama 3's; a cost-model replica accepts prompt ids below it
    max_position_embeddings: int = 131_072
    host_bandwidth: float = 48e9  # bytes/s between host memory and the device, each way
    disk_bandwidth: float = 5.25e9  # bytes/s read from local disk into the device

    def tier_bandwidth(self, tier: str) -> float:
        """Bytes/s of a lower tier ("CPU" or "STORAGE") to and from the device."""
        if tier == MEDIUM_CPU:
            return self.host_bandwidth
        if tier == MEDIUM_STORAGE:
            return self.disk_bandwidth
        raise ValueError(f"no bandwidth modelled for tier {tier!r}")

    @property
    def attn_flops(self) -> float:
        """FLOPs per (query token, key token) pair: QK^T and AV over all layers."""
        return 4.0 * self.layers * self.heads * self.head_dim


H100_8B = Profile(
    name="h100-8b",
    params=8.03e9,
    layers=32,
    heads=32,
    head_dim=128,
    kv_bytes_per_token=2 * 32 * 8 * 128 * 2,
    weight_bytes=16.06e9,
    peak_flops=0.45 * 989e12,
    mem_bw=0.75 * 3.35e12,
    overhead_s=1.5e-3,
    kv_tokens=434_176,
)

A100_8B = dataclasses.replace(
    H100_8B,
    name="a100-8b",
    peak_flops=0.45 * 312e12,
    mem_bw=0.75 * 2.039e12,
    host_bandwidth=0.75 * 32e9,
)

PROFILES: dict[str, Profile] = {p.name: p for p in (H100_8B, A100_8B)}
SIM_MODEL_PREFIX = "sim:"  # ``--model sim:h100-8b``: a replica that runs the cost model


def sim_profile(model: str) -> Profile | None:
    """The profile a ``sim:<profile>`` model name asks for; None for a real model."""
    if not model.startswith(SIM_MODEL_PREFIX):
        return None
    name = model[len(SIM_MODEL_PREFIX) :]
    if name not in PROFILES:
        raise ValueError(f"unknown cost-model profile {name!r}; choose from {', '.join(PROFILES)}")
    return PROFILES[name]


class CostModel:
    """Step times for one profile; the simulator accumulates (n, p0) per step, then asks."""

    __slots__ = ("_attn", "_dense", "_kvb", "p")

    def __init__(self, profile: Profile = H100_8B) -> None:
        self.p = profile
        self._dense = 2.0 * profile.params
        self._attn = profile.attn_flops
        self._kvb = float(profile.kv_bytes_per_token)

    def coefficients(self, tiers: Sequence[str] = ()) -> CostCoefficients:
        """The profile as a replica reports it: the same roofline, term by term, and the
        bandwidth of each lower tier it has (``tiers``: "CPU", "STORAGE")."""
        p = self.p
        return CostCoefficients(
            prefill_s_per_token=self._dense / p.peak_flops,
            attention_s_per_pair=self._attn / p.peak_flops,
            step_overhead_s=p.overhead_s,
            weights_read_s=p.weight_bytes / p.mem_bw,
            kv_read_s_per_token=self._kvb / p.mem_bw,
            kv_capacity_tokens=p.kv_tokens,
            max_batched_tokens=p.max_batched_tokens,
            max_num_seqs=p.max_num_seqs,
            source=f"profile:{p.name}",
            kv_bytes_per_token=p.kv_bytes_per_token,
            tier_bytes_per_s={t: p.tier_bandwidth(t) for t in tiers},
        )

    def step_time(
        self, tokens: int, pair_sum: float, ctx_sum: int, transfer_s: float = 0.0
    ) -> float:
        """``tokens`` = sum n, ``pair_sum`` = sum (n*p0 + n*(n-1)/2), ``ctx_sum`` = sum (p0+n);
        ``transfer_s``: the step's block copies to and from lower tiers (:meth:`transfer_s`),
        which overlap its compute and bound it from below."""
        p = self.p
        flops = tokens * self._dense + self._attn * pair_sum
        nbytes = p.weight_bytes + self._kvb * ctx_sum
        return p.overhead_s + max(flops / p.peak_flops, nbytes / p.mem_bw, transfer_s)

    def transfer_s(self, tier: str, load_tokens: int, store_tokens: int = 0) -> float:
        """Seconds the copies of one step take: ``load_tokens`` from ``tier`` into the
        device and ``store_tokens`` out to it, each way at the tier's bandwidth, the two
        directions at once (full duplex)."""
        return self._kvb * max(load_tokens, store_tokens) / self.p.tier_bandwidth(tier)

    def decode_run(self, batch: int, pos_sum: int, steps: int, start: float = 0.0) -> list[float]:
        """End times, after ``start``, of ``steps`` pure decode steps of ``batch`` requests
        whose positions sum to ``pos_sum`` at the first step (each step adds ``batch``): the
        same sums as :meth:`step_time`, step after step. A plain loop: runs are a few dozen
        steps, where numpy's per-call cost was most of the time."""
        p = self.p
        dense, attn, kvb = batch * self._dense, self._attn, self._kvb
        peak, bw, weights, overhead = p.peak_flops, p.mem_bw, p.weight_bytes, p.overhead_s
        ends: list[float] = []
        t, pos = start, pos_sum
        for _ in range(steps):
            compute, memory = (dense + attn * pos) / peak, (weights + kvb * (pos + batch)) / bw
            t += overhead + (compute if compute > memory else memory)
            ends.append(t)
            pos += batch
        return ends


def attention_weight(cost: CostCoefficients) -> float:
    """One attention (query, key) pair's cost in prompt tokens of dense work, by a replica's
    cost model: what bounds its prompt chunks by cost (``SchedulerConfig.attention_weight``)."""
    if cost.prefill_s_per_token <= 0:
        return 0.0
    return cost.attention_s_per_pair / cost.prefill_s_per_token


def fair_share_floor(cost: CostCoefficients) -> int:
    """Prompt tokens whose dense work lasts as long as a step's fixed cost (overhead and one
    read of the weights): the least a step shared between tenants computes
    (``SchedulerConfig.min_prefill_share_tokens``). 0 when the model gives no per-token cost."""
    if cost.prefill_s_per_token <= 0:
        return 0
    return int(cost.decode_step_s(0, 0) / cost.prefill_s_per_token)


# Dense bf16 FLOP/s and memory bytes/s from the vendors' datasheets (SXM / PCIe as named).
DEVICE_PEAKS: dict[str, tuple[float, float]] = {
    "H200": (989e12, 4.8e12),
    "H100": (989e12, 3.35e12),
    "A100": (312e12, 2.0e12),
    "L40S": (362e12, 0.864e12),
    "A10G": (125e12, 0.6e12),
    "L4": (121e12, 0.3e12),
}
PREFILL_EFFICIENCY, DECODE_EFFICIENCY = 0.45, 0.75  # as in h100-8b (see the docstring)


def measure_device_peaks(seconds: float = 0.2) -> tuple[float, float]:
    """(FLOP/s, bytes/s) this process gets from its device, by a short timed matmul and
    copy: for CPUs and GPUs missing from :data:`DEVICE_PEAKS`. Already effective figures."""
    import time

    import torch

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.randn(512, 1024, device=dev)
    b = torch.randn(1024, 1024, device=dev)
    src = torch.empty(8 << 20, dtype=torch.uint8, device=dev)  # 8 MiB
    dst = torch.empty_like(src)

    def rate(fn, work: float) -> float:
        fn()
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / 2:
            fn()
            n += 1
        if dev == "cuda":
            torch.cuda.synchronize()
        return work * n / (time.perf_counter() - start)

    return rate(lambda: a @ b, 2.0 * 512 * 1024 * 1024), rate(
        lambda: dst.copy_(src), 2.0 * src.numel()
    )


def profile_for_model(
    name: str,
    config: object,
    num_params: int,
    dtype_bytes: int,
    kv_tokens: int,
    max_batched_tokens: int,
    max_num_seqs: int,
    device_name: str | None = None,
    overhead_s: float = 1.5e-3,
) -> Profile:
    """A replica's profile from its own model config (a transformers ``PretrainedConfig``)
    and device: datasheet peaks times the efficiencies above for a known GPU, else a short
    measurement of this device."""
    layers = int(config.num_hidden_layers)  # type: ignore[attr-defined]
    heads = int(config.num_attention_heads)  # type: ignore[attr-defined]
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)  # type: ignore[attr-defined]
    known = next((v for k, v in DEVICE_PEAKS.items() if device_name and k in device_name), None)
    if known is not None:
        flops, bw = known[0] * PREFILL_EFFICIENCY, known[1] * DECODE_EFFICIENCY
    else:
        flops, bw = measure_device_peaks()
    return Profile(
        name=name,
        params=float(num_params),
        layers=layers,
        heads=heads,
        head_dim=head_dim,
        kv_bytes_per_token=2 * layers * kv_heads * head_dim * dtype_bytes,
        weight_bytes=float(num_params * dtype_bytes),
        peak_flops=flops,
        mem_bw=bw,
        overhead_s=overhead_s,
        kv_tokens=kv_tokens,
        max_batched_tokens=max_batched_tokens,
        max_num_seqs=max_num_seqs,
    )
