"""``lora_affinity``: the adapter-affinity baseline, as llm-d's LoRA affinity scorer ranks.

Each replica scores 1 when the request's adapter is resident there (its last report, or
placed there by this router since), 0.8 when a slot is free for it, 0 otherwise; the
highest score wins, ties go to fewer requests in flight, then a seeded coin. A request
without an adapter, or a replica that reports no slots, falls to load alone. It knows no
prefix and prices nothing in seconds: a baseline to measure kv's adapter pricing against.
"""

from __future__ import annotations

from collections.abc import Sequence

from .load import LoadTracker
from .lora_price import AdapterTracker
from .policy import Decision, Policy, RequestView

RESIDENT, FREE_SLOT = 1.0, 0.8  # llm-d's scores


class LoRAAffinity(Policy):
    """Most resident wins, ties by load (module docstring)."""

    name = "lora_affinity"

    def __init__(self, load: LoadTracker | None = None, seed: int | str = 0) -> None:
        super().__init__(load, seed)
        self.adapters = AdapterTracker()

    def _score(self, replica: str, adapter: str, now: float) -> float:
        report, at = self.load.report_of(replica)
        if self.adapters.resident(replica, adapter, report, at, now):
            return RESIDENT
        if report is None or not report.lora_slots or report.lora_free_slots > 0:
            return FREE_SLOT
        return 0.0

    def choose(self, req: RequestView, replicas: Sequence[str], now: float) -> Decision:
        load = {r: self.load.get(r, now)[3] for r in replicas}
        if req.lora_name is None:
            return Decision(self._least(replicas, {r: float(n) for r, n in load.items()}), 0)
        # highest score first, then fewest in flight: one key, lowest wins
        key = {r: (-self._score(r, req.lora_name, now), load[r]) for r in replicas}
        low = min(key.values())
        return Decision(self.rng.choice([r for r in replicas if key[r] == low]), 0, "load")

    def on_routed(self, req: RequestView, decision: Decision, now: float) -> None:
        super().on_routed(req, decision, now)
        if req.lora_name is not None:
            self.adapters.routed(req.request_id, decision.replica, req.lora_name, now)

    def on_finished(self, request_id: str, now: float, output_tokens: int | None = None) -> None:
        self.adapters.finished(request_id)
        super().on_finished(request_id, now, output_tokens)

    def on_replica_removed(self, replica: str) -> list[str]:
        self.adapters.drop_replica(replica)
        return super().on_replica_removed(replica)
