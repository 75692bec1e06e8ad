"""``GET /fleet``: the fleet as this front door sees it, for operators (admin keys only).

Why a JSON view beside ``/metrics``: metrics are numbers over time for dashboards; an
operator debugging a routing decision or a silent 0% hit rate needs the facts at one
instant, by replica -- where it runs, whether it is routable, what it reported last, how
much of its cache the index holds, how it hashes and where its event stream stands.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import msgspec

from kvroute.events.transport import ReplicaStats

from ...fleet.admission import Admission
from ...fleet.fleet import Fleet


def fleet_view(
    fleet: Fleet, policy: str, admission: Admission, events: dict[str, ReplicaStats]
) -> dict[str, Any]:
    """One JSON object: the front door's settings (``policy``: its name; ``admission``: its
    budget) and one entry per replica (``events``: the subscriber's stats)."""
    now = time.monotonic()
    replicas = []
    for rid, rep in sorted(fleet.replicas.items()):
        info, report, st = rep.info, fleet.load.last_report(rid), events.get(rid)
        replicas.append(
            {
                "replica_id": rid,
                "node_id": info.node_id,
                "node_ip": info.node_ip,
                "pid": info.pid,
                "incarnation": info.incarnation,
                "healthy": rep.alive,
                "cordoned": rid in fleet.cordoned,
                "draining": rid in fleet.draining,
                "model": info.model,
                "max_model_len": info.max_model_len,
                "hash": {
                    "algo": info.hash_algo,
                    "seed": info.hash_seed,
                    "form": info.hash_form,
                    "block_size": info.block_size,
                },
                # Indexed by token ids (its engine's hash is not reproducible): what the
                # translation kept and dropped, in blocks (events/translate.py).
                "token_index": _token_index(fleet, rid),
                "data_endpoint": info.data_endpoint,
                "kv_blocks_total": info.num_blocks,
                "cached_blocks_indexed": fleet.index.num_blocks(rid),
                "load": msgspec.to_builtins(report) if report is not None else None,
                "in_flight_here": fleet.load.in_flight_at(rid),
                "routed": rep.routed,
                "restarts": rep.restarts,
                "failures": rep.failures,
                "events": None
                if st is None
                else {
                    "endpoint": info.events_endpoint,
                    "replay_endpoint": info.replay_endpoint,
                    "last_seq": st.last_seq,
                    "delivered": st.delivered,
                    "gaps": st.gaps,
                    "malformed": st.malformed,
                    "seconds_since_last_message": round(now - st.last_heard, 3)
                    if st.last_heard
                    else None,
                },
            }
        )
    return {
        "model": fleet.model,
        "policy": policy,
        "hash": {
            "algo": fleet.hash_config.algo,
            "seed": fleet.hash_config.seed,
            "block_size": fleet.hasher.block_size,
            "form": fleet.hash_form,
        },
        "max_in_flight": admission.max_in_flight,
        "in_flight": admission.in_flight,
        "replicas": replicas,
    }


def _token_index(fleet: Fleet, rid: str) -> dict[str, int] | None:
    tr = fleet.translators.get(rid)
    if tr is None:
        return None
    return {"engine_hashes": len(tr), **dataclasses.asdict(tr.stats)}
