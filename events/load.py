"""What a replica tells routers about its speed and its load, so they can price it in seconds.

Why the replica says it, and not a router flag: each replica knows its own hardware and
model. A router that prices every replica with that replica's own coefficients places work
correctly on a mixed fleet (an H100 beside an A100, an 8B model beside a 70B) with no flag.

The step-time model behind :class:`CostCoefficients` is a roofline: one engine step runs a
batch of prefill chunks and decode tokens together and takes ::

    t = step_overhead_s + max(compute, memory)
    compute = prefill_s_per_token * (tokens in the step) + attention_s_per_pair * (pairs)
    memory  = weights_read_s + kv_read_s_per_token * (KV tokens read)

so a long prefill is compute-bound (and quadratic through attention pairs), and a decode
step is memory-bound: its time grows with the total context of the batch it reads.

Lower KV tiers: a block a replica holds in host memory (``"CPU"``) or on local disk
(``"STORAGE"``) is not recomputed but loaded, which takes its bytes over the tier's
bandwidth into device memory: ``kv_bytes_per_token / tier_bytes_per_s[tier]`` seconds per
token (:meth:`CostCoefficients.tier_load_s_per_token`). A replica reports both, measured at
start, beside its other coefficients. Where it does not (vLLM, an older kvroute), a known
tier's token is priced at a conservative share of the replica's own prefill token
(:data:`DEFAULT_TIER_LOAD_SHARE`): never free, never a miss, whatever the model and device.

LoRA adapters: a replica serving adapters reports which ones sit in its device slots, how
many slots are free, which adapters its running requests hold (their slots cannot be given
up) and which it keeps in host memory (:class:`LoadReport`'s ``lora_*`` fields: residency,
what the replica holds, never a label of recent activity), and beside its coefficients what
one adapter load costs it, measured (``lora_load_s``: host memory to a device slot;
``lora_read_s``: disk to host memory). A replica that reports none (vLLM, an older kvroute)
is priced with :data:`DEFAULT_LORA_LOAD_S` / :data:`DEFAULT_LORA_READ_S`.
"""

from __future__ import annotations

import msgspec

from .wire import MEDIUM_CPU, MEDIUM_STORAGE

# A known tier's load per token, as a share of one dense prefill token, for a replica that
# reports no bandwidth for it (or no KV size). Conservative against what the hardware does
# and what peers assume: Llama-3.1-8B on an H100 loads a host token in 0.08 of its prefill
# at 48 GB/s (0.36 at 10 GB/s); Dynamo credits a host block 0.75 of a device one (a load
# share of 0.25), llm-d 0.8 (0.2); for disk 0.25 (0.75) and 0.4 (0.6). Below 1, so a copy
# there is never priced as a miss; above 0, never as a device hit.
DEFAULT_TIER_LOAD_SHARE: dict[str, float] = {MEDIUM_CPU: 0.5, MEDIUM_STORAGE: 0.85}


class CostCoefficients(msgspec.Struct, frozen=True, kw_only=True):
    """One replica's step-time model, in its own seconds (see the module docstring)."""

    prefill_s_per_token: float  # dense GEMMs per token (2 x params / effective FLOP/s)
    attention_s_per_pair: float  # QK^T + AV per (query, key) pair, all layers
    step_overhead_s: float  # scheduling, sampling, launch: per step, whatever it holds
    weights_read_s: float  # reading every weight once: the floor of a decode step
    kv_read_s_per_token: float  # reading one token's K and V, all layers
    kv_capacity_tokens: int  # KV cache size
    max_batched_tokens: int  # token budget per step (chunked prefill)
    max_num_seqs: int
    source: str = "profile"  # "profile:<name>" or "measured"
    # Lower tiers (module docstring); absent from older replicas' info: 0 / {} = unknown.
    kv_bytes_per_token: int = 0  # one token's K and V, all layers, as a tier copies them
    tier_bytes_per_s: dict[str, float] = msgspec.field(default_factory=dict)  # tier -> load
    # bandwidth into device memory, bytes/s, for the tiers this replica has
    # LoRA adapters (module docstring); 0: not reported (the DEFAULT_LORA_* figures apply).
    lora_load_s: float = 0.0  # one adapter, host memory -> a device slot
    lora_read_s: float = 0.0  # one adapter, disk -> host memory

    def adapter_load_s(self, in_host: bool) -> float:
        """Seconds to bring one adapter into a device slot: from host memory, or (not
        there) read from disk first."""
        load = self.lora_load_s or DEFAULT_LORA_LOAD_S
        return load if in_host else load + (self.lora_read_s or DEFAULT_LORA_READ_S)

    def prefill_s(self, num_new: int, num_cached: int = 0) -> float:
        """Seconds to prefill ``num_new`` tokens on top of ``num_cached`` cached ones."""
        if num_new <= 0:
            return 0.0
        pairs = num_new * num_cached + num_new * (num_new + 1) / 2
        steps = -(-num_new // self.max_batched_tokens)
        return (
            steps * self.step_overhead_s
            + num_new * self.prefill_s_per_token
            + pairs * self.attention_s_per_pair
        )

    def tier_load_s_per_token(self, tier: str) -> float | None:
        """Seconds to load one token's KV from ``tier`` (a
        :func:`~kvroute.events.wire.tier_name`) into device memory; None where a copy there
        earns no credit: a tier of unknown cost this replica reports no bandwidth for
        (``kvroute.router.routing.index_tiers`` says why)."""
        bw = self.tier_bytes_per_s.get(tier)
        if bw is not None and bw > 0 and self.kv_bytes_per_token > 0:
            return self.kv_bytes_per_token / bw
        share = DEFAULT_TIER_LOAD_SHARE.get(tier)
        return None if share is None else share * self.prefill_s_per_token

    def decode_step_s(self, num_seqs: int, context_tokens: float) -> float:
        """One decode step of ``num_seqs`` sequences holding ``context_tokens`` KV tokens."""
        compute = num_seqs * self.prefill_s_per_token + context_tokens * self.attention_s_per_pair
        memory = self.weights_read_s + context_tokens * self.kv_read_s_per_token
        return self.step_overhead_s + max(compute, memory)


class LoadReport(msgspec.Struct, frozen=True, kw_only=True):
    """A replica's load at one instant, as its scheduler sees it.

    ``queued_prefill_tokens`` counts prompt tokens not yet computed (waiting requests before
    their prefix lookup, and the unfinished part of running prefills); decode figures cover
    running requests past their prompt. Free blocks include cached blocks no request holds
    (they are evictable); a shortage of them means preemption.
    """

    num_waiting: int
    num_running: int
    num_decoding: int
    queued_prefill_tokens: int
    decode_context_tokens: int
    free_blocks: int
    total_blocks: int
    # LoRA residency (module docstring); defaults: a replica that serves no adapters, or
    # does not say (a vLLM engine, an older kvroute), so old reports still decode.
    lora_slots: int = 0  # device slots (max_loras); 0: no adapters, or not reported
    lora_free_slots: int = 0  # slots holding no adapter
    lora_resident: tuple[str, ...] = ()  # adapters in device slots now
    lora_running: tuple[str, ...] = ()  # of those, the ones running requests hold
    lora_host: tuple[str, ...] = ()  # adapters in host memory (a slot load away)
    # Adapter reads that failed here (unreadable, changed since registered, or past their
    # deadline), in total; and those abandoned at their deadline whose thread still hangs.
    lora_read_failures: int = 0
    lora_reads_hung: int = 0
    # The disk KV tier's health (replica/kv_tiers/disk_reads.py, docs/kv-tiers.md): one of the
    # DISK_* states, and its reads abandoned at their deadline, in total.
    kv_disk_state: int = 0
    kv_disk_read_timeouts: int = 0
    # P/D (events/kv_transfer.py): the bytes per second its pulls from other replicas took,
    # measured (a running mean; 0: none yet), and the prompt blocks it holds leased for
    # replicas that decode its handed-off requests.
    kv_link_bytes_per_s: float = 0.0
    kv_leased_blocks: int = 0


# LoadReport.kv_disk_state: no disk tier (or not reported); serving; unresponsive (every
# reader stuck in a read that did not answer: no disk loads until one does); off (its
# folder was deleted or replaced: what it held was withdrawn).
DISK_NONE, DISK_OK, DISK_UNRESPONSIVE, DISK_OFF = 0, 1, 2, 3


# One adapter's load for a replica that reports none: Llama-3.1-8B, rank 16 on all seven
# projections, bf16 (2 bytes x 16 x sum(d_in + d_out) = 81,920 x 32 layers: 84 MB), over a
# PCIe 4 x16 link at 25 GB/s effective (host -> slot), and read from a local NVMe disk at
# 2 GB/s with safetensors' parse (disk -> host). Conservative beside the cost model's
# h100-8b link (48 GB/s), which the simulator's replicas report instead.
DEFAULT_LORA_LOAD_S = 84e6 / 25e9
DEFAULT_LORA_READ_S = 84e6 / 2e9

# For a replica that reports no coefficients (an older kvroute, a vLLM engine): an 8B model
# in bf16 on one H100 SXM, the figures of kvroute.replica.model.cost_model's ``h100-8b`` profile
# (a test keeps the two equal). Only ratios between replicas matter for a uniform fleet.
REFERENCE_COEFFICIENTS = CostCoefficients(
    prefill_s_per_token=2 * 8.03e9 / (0.45 * 989e12),
    attention_s_per_pair=4 * 32 * 32 * 128 / (0.45 * 989e12),
    step_overhead_s=1.5e-3,
    weights_read_s=16.06e9 / (0.75 * 3.35e12),
    kv_read_s_per_token=131_072 / (0.75 * 3.35e12),
    kv_capacity_tokens=434_176,
    max_batched_tokens=8192,
    max_num_seqs=256,
    source="reference:h100-8b",
    kv_bytes_per_token=131_072,
)
