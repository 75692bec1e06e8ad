"""LoRA adapters in the simulator's replicas: device slots, a host LRU, and load times.

What is modelled is what routing sees and pays, inside the engine's own scheduler (its
``max_loras`` rule: a step mixes at most ``max_loras`` adapters; a request whose adapter is
not in memory is passed over while it is read):

- device slots: ``max_loras`` adapters, least recently used out first, never one a running
  request holds (as :class:`~kvroute.replica.model.lora_store.LoRAStore`); a step whose requests
  need an adapter not in a slot copies it in from host memory, on the step, which lasts
  ``load_s`` longer per copy (the engine copies before the forward pass);
- host memory: ``max_cpu_loras`` adapters, least recently used out first, never one in a
  slot or held by a running request; an adapter not there is read from disk in the
  background (``read_s``, reads in parallel, as the engine's loader threads), and its
  requests wait in the queue meanwhile, not the step;
- sizes: an adapter of rank ``r`` on projections ``(d_in, d_out)`` holds ``r * (d_in +
  d_out)`` weights per projection and layer (A is ``d_in x r``, B is ``r x d_out``), in the
  profile's 2-byte dtype (:func:`adapter_bytes`); a copy takes its bytes over the host
  link (``Profile.host_bandwidth``), a read over the disk's (``Profile.disk_bandwidth``).

Replicas report their slots, resident, running and host adapters in their load reports and
``load_s`` / ``read_s`` in their coefficients, as a live engine does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvroute.replica.model.cost_model import Profile

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DTYPE_BYTES = 2  # bf16, as the profiles' weights


def projection_shapes(p: Profile) -> dict[str, tuple[int, int]]:
    """(d_in, d_out) of a Llama-architecture layer's projections, from the profile: hidden
    = heads x head_dim; the K/V width from the KV bytes per token (2 tensors, 2 bytes, every
    layer); the MLP width from the parameters left once attention and the embeddings (tied
    out, 2 x vocab x hidden) are counted (14,336 for Llama-3.1-8B)."""
    hidden = p.heads * p.head_dim
    kv = p.kv_bytes_per_token // (2 * DTYPE_BYTES * p.layers)
    per_layer = (p.params - 2 * p.vocab_size * hidden) / p.layers
    mlp = round((per_layer - 2 * hidden * hidden - 2 * hidden * kv) / (3 * hidden))
    return {
        "q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
        "o_proj": (hidden, hidden), "gate_proj": (hidden, mlp), "up_proj": (hidden, mlp),
        "down_proj": (mlp, hidden),
    }  # fmt: skip


def adapter_bytes(p: Profile, rank: int, targets: Collection[str] = TARGETS) -> int:
    """Bytes of one adapter of ``rank`` on ``targets`` in every layer of ``p``'s model."""
    shapes = projection_shapes(p)
    return rank * sum(sum(shapes[t]) for t in targets) * p.layers * DTYPE_BYTES


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """The fleet's adapters: slots and host entries per replica, and their size."""

    max_loras: int = 4
    max_cpu_loras: int = 16
    rank: int = 16
    targets: tuple[str, ...] = TARGETS

    def times(self, p: Profile) -> tuple[float, float]:
        """(host -> slot, disk -> host) seconds of one adapter on profile ``p``."""
        size = adapter_bytes(p, self.rank, self.targets)
        return size / p.host_bandwidth, size / p.disk_bandwidth


class SimLoRA:
    """One replica's adapters: slots, host LRU, reads in flight (module docstring)."""

    __slots__ = ("host", "load_s", "max_cpu", "max_loras", "now", "read_s", "reading", "reads",
                 "slot_loads", "slots")  # fmt: skip

    def __init__(self, cfg: LoRAConfig, load_s: float, read_s: float) -> None:
        self.max_loras, self.max_cpu = cfg.max_loras, max(cfg.max_cpu_loras, cfg.max_loras)
        self.load_s, self.read_s = load_s, read_s
        self.slots: OrderedDict[str, None] = OrderedDict()  # oldest use first
        self.host: OrderedDict[str, None] = OrderedDict()
        self.reading: dict[str, float] = {}  # adapter -> when its read ends
        self.now = 0.0  # the fleet's clock at the step being scheduled
        self.slot_loads = self.reads = 0

    def ready(self, req: Any) -> bool:
        """The scheduler's ``lora_ready``: in host memory now (a read that has ended lands
        there); else its read starts, if not under way, and the request waits."""
        name = req.lora_name
        if name in self.host:
            self.host.move_to_end(name)
            return True
        end = self.reading.get(name)
        if end is None:
            self.reading[name] = self.now + self.read_s
            self.reads += 1
            return False
        if end > self.now:
            return False
        del self.reading[name]
        self.host[name] = None
        self._trim_host(())
        return True

    def next_read_end(self) -> float | None:
        return min(self.reading.values(), default=None)

    def step(self, needed: set[str], running: set[str]) -> int:
        """Puts the step's adapters in slots; returns how many were copied in."""
        copies = 0
        for name in needed:
            if name in self.slots:
                self.slots.move_to_end(name)
                continue
            if len(self.slots) >= self.max_loras:
                victim = next((a for a in self.slots if a not in needed and a not in running),
                              None)  # fmt: skip
                if victim is None:  # the scheduler admits no more adapters than slots
                    raise RuntimeError(f"no slot for LoRA adapter {name!r}")
                del self.slots[victim]
            self.slots[name] = None
            if name not in self.host:  # the scheduler admits adapters in memory only
                raise RuntimeError(f"LoRA adapter {name!r} is not in host memory")
            copies += 1
        self.slot_loads += copies
        self._trim_host(running)
        return copies

    def _trim_host(self, running: Collection[str]) -> None:
        for name in list(self.host):
            if len(self.host) <= self.max_cpu:
                return
            if name not in self.slots and name not in running:
                del self.host[name]

    def residency(self, running: Collection[str]) -> dict[str, Any]:
        """``LoadReport``'s ``lora_*`` fields, as the engine's ``LoRAStore.residency``."""
        return {
            "lora_slots": self.max_loras,
            "lora_free_slots": self.max_loras - len(self.slots),
            "lora_resident": tuple(self.slots),
            "lora_running": tuple(sorted(running)),
            "lora_host": tuple(self.host),
        }


def adapter_metrics(done: Sequence[Any], slot_loads: int, reads: int) -> dict[str, Any]:
    """A run's adapter figures: slot loads and disk reads per 1,000 completed requests, and
    TTFT per adapter (p50, p99), with the worst adapter's p99 over the median adapter's
    (every adapter that completed a request counts), and its p99 wait before a first step
    (``queued_p99``: a wait for a slot or behind other prefills, not its own prefill).
    ``done``: completed requests (``spec``, ``first_s``, ``scheduled_s``)."""
    ttfts: dict[str, list[float]] = {}
    queued: dict[str, list[float]] = {}
    for r in done:
        name = r.spec.lora_name
        if name is not None:
            ttfts.setdefault(name, []).append(r.first_s - r.spec.arrival_s)
            at = r.scheduled_s if r.scheduled_s is not None else r.first_s  # a retry: none
            queued.setdefault(name, []).append(at - r.spec.arrival_s)
    per = {
        name: {
            "requests": len(xs),
            "p50": float(np.percentile(xs, 50)),
            "p99": float(np.percentile(xs, 99)),
            "queued_p99": float(np.percentile(queued[name], 99)),
        }
        for name, xs in sorted(ttfts.items())
    }
    median = float(np.median([d["p99"] for d in per.values()])) if per else float("nan")
    worst = max(per.values(), key=lambda d: d["p99"], default=None)
    nan = float("nan")
    k = 1000.0 / max(len(done), 1)
    return {
        "adapter_loads_per_1k": slot_loads * k,
        "adapter_reads_per_1k": reads * k,
        "ttft_by_adapter": per,
        "adapter_p99_median_s": median,
        "adapter_p99_worst_s": worst["p99"] if worst else nan,
        "adapter_worst_queued_p99_s": worst["queued_p99"] if worst else nan,
        "adapter_p99_spread": worst["p99"] / median if worst and median > 0 else nan,
    }
