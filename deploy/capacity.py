"""What a Ray cluster can hold: how many more replicas like a running one fit on its nodes
now, and how many its autoscaler could ever make room for.

Why: a Ray actor whose resources no node has is not refused; it waits, pending, for ever
(``kvroute scale --replicas 1000`` on a 2-CPU Ray made 998 such detached actors). So
``kvroute scale`` and ``kvroute serve --max-replicas`` ask first, from the twin's Ray
options (:meth:`kvroute.replica.serve.actor.ReplicaServer.launch_spec`), and refuse or clamp a
size the cluster cannot hold, unless the operator says nodes are coming
(``--wait-for-resources``).

A cluster with an autoscaler adds nodes: its limit is read where Ray keeps it (autoscaler
v2 and KubeRay publish their node groups in the GCS; the cluster launcher leaves
``~/ray_bootstrap_config.yaml`` on the head). Where none is found the cluster is taken as
it is now.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

BATCH = 8  # at most this many replicas wait for resources at once (more if more fit now)
BOOTSTRAP_CONFIG = "~/ray_bootstrap_config.yaml"  # the cluster launcher's, on the head


def need_of(options: Mapping[str, Any]) -> dict[str, float]:
    """The Ray resources one replica started with ``options`` (``ReplicaLaunch.options``)
    reserves on its node: CPUs (1 unless given, as ``start_replica``), GPUs, ``memory``
    and custom resources."""
    need = {
        "CPU": float(options.get("num_cpus", 1) or 0),
        "GPU": float(options.get("num_gpus", 0) or 0),
        "memory": float(options.get("memory", 0) or 0),
    }
    for key, value in (options.get("resources") or {}).items():
        need[key] = need.get(key, 0.0) + float(value)
    if options.get("accelerator_type"):  # Ray asks for it as this resource
        need[f"accelerator_type:{options['accelerator_type']}"] = 0.001
    return {k: v for k, v in need.items() if v > 0}


def fits(free: Mapping[str, float], need: Mapping[str, float]) -> int | None:
    """How many replicas needing ``need`` fit in ``free`` (None: no limit, as it needs
    nothing)."""
    counts = [free.get(k, 0.0) / v for k, v in need.items() if v > 0]
    if not counts:
        return None
    least = min(counts)
    return sys.maxsize if math.isinf(least) else max(0, math.floor(least + 1e-9))


def fits_on_nodes(nodes: Iterable[Mapping[str, float]], need: Mapping[str, float]) -> int | None:
    """How many fit on these nodes' free resources, each replica on one node."""
    if not need:
        return None
    return sum(fits(node, need) or 0 for node in nodes)


def max_from_groups(
    groups: Iterable[tuple[Mapping[str, float], int]], cap: Mapping[str, float] | None = None
) -> dict[str, float]:
    """The most of each resource a cluster of node groups ``(resources per node, most
    nodes; -1: no limit)`` can have, within ``cap`` (a cluster-wide limit per resource)."""
    out: dict[str, float] = {}
    for resources, count in groups:
        for key, value in resources.items():
            if value:
                more = math.inf if count < 0 or value < 0 else value * count
                out[key] = out.get(key, 0.0) + more
    for key, limit in (cap or {}).items():
        if key in out and limit:
            out[key] = min(out[key], limit)
    return out


def bootstrap_limits(config: Mapping[str, Any]) -> dict[str, float]:
    """:func:`max_from_groups` of a cluster launcher's config (``available_node_types``:
    the head once, each worker type ``max_workers`` times, at most the cluster's
    ``max_workers`` of any)."""
    most = config.get("max_workers")
    head = config.get("head_node_type")
    groups = []
    for name, node_type in (config.get("available_node_types") or {}).items():
        count = 1 if name == head else int(node_type.get("max_workers", most or 0))
        if name != head and most is not None:
            count = min(count, int(most))
        groups.append((node_type.get("resources") or {}, count))
    return max_from_groups(groups)


def autoscaler_limits() -> tuple[bool, dict[str, float] | None]:
    """(whether an autoscaler's config was found, the most of each resource it can bring
    up). Ray's own reading of the GCS first (autoscaler v2, KubeRay), then the cluster
    launcher's file on this head; (False, None): the cluster adds no nodes we know of."""
    try:
        from ray._private.state import state

        config = state.get_cluster_config()
    except Exception:  # an older or newer Ray: no v2 config to read
        config = None
    if config is not None and config.node_group_configs:
        groups = [(dict(g.resources), int(g.max_count)) for g in config.node_group_configs]
        return True, max_from_groups(groups, dict(config.max_resources))
    path = os.path.expanduser(BOOTSTRAP_CONFIG)
    if os.path.isfile(path):
        try:
            import yaml

            with open(path) as f:
                return True, bootstrap_limits(yaml.safe_load(f) or {})
        except Exception:  # unreadable: an autoscaler, of unknown limits
            return True, None
    return False, None


@dataclass(frozen=True, slots=True)
class Room:
    """How many more replicas the cluster holds: ``now`` on its nodes' free resources
    (None: no limit, a replica needs nothing), ``most`` once its autoscaler added every
    node it may (None: no autoscaler, or limits not known); ``autoscaler``: one was found."""

    need: dict[str, float]
    now: int | None
    most: int | None = None
    autoscaler: bool = False
    free: dict[str, float] = field(default_factory=dict)  # the cluster's, for the refusal

    def grows_to(self, replicas: int) -> int | None:
        """The largest fleet of ``replicas`` plus what fits (None: no limit known)."""
        if self.now is None:
            return None
        if self.autoscaler:
            return None if self.most is None else replicas + max(self.now, self.most)
        return replicas + self.now

    def refusal(self, more: int) -> str | None:
        """Why ``more`` new replicas cannot be held (None: they can, or may)."""
        top = self.grows_to(0)
        if top is None or more <= top:
            return None
        each = ", ".join(f"{k} {_amount(k, v)}" for k, v in self.need.items())
        if self.autoscaler:
            where = f"the cluster's autoscaler can make room for {top} more at most"
        else:
            free = ", ".join(f"{k} {_amount(k, self.free.get(k, 0.0))}" for k in self.need)
            where = f"the cluster has room for {top} more ({free} free)"
        return (
            f"{more} more replica(s) need {each} each; {where}: nothing started "
            "(--wait-for-resources waits for nodes that are coming)"
        )


def room_for(need: Mapping[str, float]) -> Room:
    """The :class:`Room` for replicas needing ``need`` on this driver's Ray cluster."""
    import ray
    from ray._private.state import state

    need = dict(need)
    now = fits_on_nodes(state.available_resources_per_node().values(), need)
    autoscaler, limits = autoscaler_limits()
    total, free = ray.cluster_resources(), ray.available_resources()
    most = None
    if autoscaler and limits is not None and now is not None and all(k in limits for k in need):
        used = {k: total.get(k, 0.0) - free.get(k, 0.0) for k in need}
        most = fits({k: limits[k] - used[k] for k in need}, need)
        if most is not None and most > 1 << 30:  # no limit in the config
            most = None
    return Room(need, now, most, autoscaler, dict(free))


def not_running(actors: Mapping[str, Any]) -> set[str]:
    """The keys of ``actors`` whose actor is not ``ALIVE`` in the GCS: waiting for
    resources, still in its ``__init__`` (loading its model), or restarting. None of these
    serves a request, so none needs a drain. Empty when the table cannot be read."""
    try:
        from ray._private.state import actors as actor_table

        alive = actor_table(actor_state_name="ALIVE")
        return {key for key, a in actors.items() if a._actor_id.hex() not in alive}
    except Exception:  # a Ray without this table: every replica is drained, as before
        return set()


def _amount(key: str, value: float) -> str:
    if key == "memory" or key == "object_store_memory":
        return f"{value / 2**30:.1f} GiB"
    return f"{value:g}"
