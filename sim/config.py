"""What a simulated fleet is, and how a run's name reads: :class:`SimConfig`, :class:`Fault`.

Split out of :mod:`.simulator` (the discrete-event loop, whose docstring says what each knob
models): the fleet's configuration (replicas, profiles, blocks, the event channel, faults,
host tiers, LoRA slots, P/D roles and the link), the pooled fleet no router can beat
(:meth:`SimConfig.pooled`), and the names of runs (:func:`split_policy`, :data:`POOLED`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kvroute.replica.core.scheduler_types import SchedulerConfig
from kvroute.replica.model.cost_model import (
    H100_8B,
    CostModel,
    Profile,
    attention_weight,
    fair_share_floor,
)

from .disagg import PD_SPLITS, roles_of
from .fetch import FETCH
from .lora import LoRAConfig

__all__ = ["NO_HOST", "POLICY_VARIANTS", "POOLED", "Fault", "SimConfig", "split_policy"]

NO_HOST = "nohost"  # a policy name's suffix: run it on the fleet without its host tier
# A run's name, not a policy's: the fleet pooled into one replica (SimConfig.pooled), which
# needs no router; its goodput is what no policy's can reach on the fleet.
POOLED = "pooled"


POLICY_VARIANTS = ("lora_blind",)  # ``kv:lora_blind`` names a policy, not a fleet variant


def split_policy(name: str) -> tuple[str, bool]:
    """(policy, with the fleet's host tier) of a run's name: ``kv`` or ``kv:nohost``
    (``kv:lora_blind`` is a policy of its own, and ``kv:lora_blind:nohost`` it without);
    ``kv:fetch``: kv with the host tier, on a fleet whose replicas fetch (:mod:`.fetch`)."""
    policy, _, variant = name.partition(":")
    head, _, rest = variant.partition(":")
    if head in POLICY_VARIANTS:
        policy, variant = f"{policy}:{head}", rest
    if variant not in ("", NO_HOST, FETCH):
        raise ValueError(
            f"unknown fleet variant {variant!r} in {name!r} (only {NO_HOST!r} or {FETCH!r})"
        )
    return policy, variant != NO_HOST


@dataclass(frozen=True, slots=True)
class Fault:
    time_s: float
    replica: int
    kind: str  # "restart" (cache lost, comes back at once), "down", "up"


@dataclass(slots=True)
class SimConfig:
    replicas: int = 8
    blocks_per_replica: int | None = None  # None: each profile's KV capacity
    block_size: int = 512
    # Replica i runs profiles[i % len(profiles)]: ("h100-8b", "a100-8b") is a mixed fleet,
    # half of each, as a fleet bought over two GPU generations.
    profiles: tuple[Profile, ...] = (H100_8B,)
    event_delay_s: float = 0.005
    event_loss: float = 0.0
    recovery_s: float = 0.5
    report_interval_s: float = 0.1
    seed: int = 0
    kv_params: dict[str, float] = field(default_factory=dict)
    faults: tuple[Fault, ...] = ()
    fast_decode: bool = True  # advance runs of pure decode steps in one event (exact)
    # The engines' scheduler knobs (EngineConfig's, `kvroute serve`'s flags); 0: off.
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 0
    # A host KV tier per replica (:mod:`.simulator`'s docstring): blocks, or a multiple of
    # the device's; neither: none. Its bandwidth is the profile's ``host_bandwidth``.
    host_blocks_per_replica: int | None = None
    host_kv_multiple: float | None = None
    lora: LoRAConfig | None = None  # adapter slots and host LRU per replica; None: none
    # The engines share prompt tokens between tenants (the scheduler's fair share); False:
    # every request in one first-come-first-served group (the pooled fleet's, see pooled).
    fair_share: bool = True
    # P/D (:mod:`.simulator`'s docstring, :mod:`.disagg`): the first ``prefill_replicas``
    # prefill, the next ``decode_replicas`` decode, the rest both; ``pd_pair``: any two may
    # share one (opt-in). A request splits where the price says it pays ("priced"), or can
    # ("always").
    prefill_replicas: int = 0
    decode_replicas: int = 0
    pd_split: str = "priced"
    pd_pair: bool = False
    # The link a pull crosses, per replica, each way: 50 GB/s, one 400 Gb/s RDMA NIC per GPU
    # (H100 nodes); its latency: the handoff's round trip (routing/disagg.py HANDOFF_RTT_S).
    link_bytes_per_s: float = 50e9
    link_latency_s: float = 1e-3
    lease_s: float = 30.0  # a prefill replica's leases (the engine's kv_lease_s)
    # Flow control in the front door (sim/door.py, `kvroute serve --flow-depth/--flow-tokens`):
    # requests wait at the door until a replica has fewer than flow_depth of its requests
    # without a first token (and fewer than flow_tokens of their prompt tokens, if given).
    # None: off, every request is routed on arrival.
    flow_depth: int | None = None
    flow_tokens: int | None = None

    @property
    def has_roles(self) -> bool:  # P/D runs: roles, or pairs on a fleet of both
        return bool(self.prefill_replicas or self.decode_replicas or self.pd_pair)

    def roles(self) -> list[str]:
        """Each replica's role (all ``both`` without roles)."""
        if self.pd_split not in PD_SPLITS:
            raise ValueError(f"pd_split must be one of {PD_SPLITS}, not {self.pd_split!r}")
        if self.link_bytes_per_s <= 0 or self.link_latency_s < 0:
            raise ValueError("the link's bandwidth must be > 0 and its latency >= 0")
        return roles_of(self.prefill_replicas, self.decode_replicas, self.replicas)

    def host_blocks(self, i: int = 0) -> int:
        """Replica ``i``'s host-tier blocks (0: no host tier)."""
        if self.host_blocks_per_replica is not None:
            return max(self.host_blocks_per_replica, 0)
        if self.host_kv_multiple is not None:
            return max(round(self.host_kv_multiple * self.blocks(i)), 0)
        return 0

    @property
    def has_host_tier(self) -> bool:
        return any(self.host_blocks(i) for i in range(self.replicas))

    def profile(self, i: int = 0) -> Profile:
        """Replica ``i``'s profile."""
        return self.profiles[i % len(self.profiles)]

    def blocks(self, i: int = 0) -> int:
        """Replica ``i``'s KV blocks."""
        if self.blocks_per_replica is not None:
            return self.blocks_per_replica
        return self.profile(i).kv_tokens // self.block_size

    @property
    def total_blocks(self) -> int:
        return sum(self.blocks(i) for i in range(self.replicas))

    @property
    def profile_names(self) -> str:
        return ",".join(p.name for p in self.profiles)

    def pooled(self) -> SimConfig:
        """The fleet as one replica of all its resources: FLOP/s, memory and link
        bandwidths, KV blocks (both tiers), batch limits and adapter slots summed, and each
        replica's copy of the weights still read every step, so a pooled step lasts as long
        as the average of the replicas' steps it merges (not less: read once, the weights
        would make its decode steps several times faster than any replica's). What no router
        can beat, in the way the pooled hit rate is: a perfect router over perfectly shared
        hardware, every step balanced. Its engine schedules first come, first served
        (``fair_share`` off): fair share trades prompt throughput for each tenant's first
        token, and one engine holds every tenant of the fleet (on the ``lora`` workload at
        6 slots and 93 req/s: TTFT p90 0.21 s with it, 0.06 s without)."""
        n = self.replicas
        ps = [self.profile(i) for i in range(n)]

        def total(field_name: str) -> float:
            return sum(getattr(p, field_name) for p in ps)

        one = dataclasses.replace(
            ps[0],
            name=f"pooled-{n}x{self.profile_names}",
            weight_bytes=total("weight_bytes"),
            peak_flops=total("peak_flops"),
            mem_bw=total("mem_bw"),
            kv_tokens=int(total("kv_tokens")),
            max_batched_tokens=int(total("max_batched_tokens")),
            max_num_seqs=int(total("max_num_seqs")),
            host_bandwidth=total("host_bandwidth"),
            disk_bandwidth=total("disk_bandwidth"),
        )
        lora = self.lora
        if lora is not None:
            lora = dataclasses.replace(
                lora, max_loras=lora.max_loras * n, max_cpu_loras=lora.max_cpu_loras * n
            )
        host = sum(self.host_blocks(i) for i in range(n))
        return dataclasses.replace(
            self,
            replicas=1,
            profiles=(one,),
            blocks_per_replica=self.total_blocks,
            host_blocks_per_replica=host if host else None,
            host_kv_multiple=None,
            lora=lora,
            faults=(),
            fair_share=False,
            prefill_replicas=0,
            decode_replicas=0,
            pd_pair=False,
        )

    def scheduler_config(self, i: int = 0) -> SchedulerConfig:
        """What a cost-model replica of replica ``i``'s profile runs (LLMEngine with
        ``sim:<profile>``)."""
        p = self.profile(i)
        cost = CostModel(p).coefficients()
        return SchedulerConfig(
            max_num_batched_tokens=p.max_batched_tokens,
            max_num_seqs=p.max_num_seqs,
            max_model_len=p.max_position_embeddings,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            max_num_partial_prefills=self.max_num_partial_prefills,
            attention_weight=attention_weight(cost),
            min_prefill_share_tokens=fair_share_floor(cost),
            max_loras=self.lora.max_loras if self.lora is not None else 0,
        )
