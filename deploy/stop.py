"""``kvroute stop``: end every replica of a fleet, and how any replica is ended.

Why its own module: ending a replica is one idea that two commands share -- ``kvroute
stop`` ends them all at once, with no drain (a scale refuses to); ``kvroute scale``
(:mod:`.scale`) ends the ones it retires, after their drain. Either way a replica closes
its engine first, so its KV disk tier's folder (tenants' data, issue 50) goes with it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from .router import REPLICA_ACTOR_PREFIX


def ray_kill(actor: Any) -> None:
    import ray

    ray.kill(actor, no_restart=True)


# How long a retired replica gets to close its engine before it is killed: its KV disk
# tier's folder (tenants' data, issue 50) is removed then, not at a later start.
STOP_GRACE_S = 10.0


def stop_replicas(actors: Sequence[Any], grace_s: float = STOP_GRACE_S) -> None:
    """Asks each replica to shut its engine down (all at once, at most ``grace_s``), then
    kills it: a replica that does not answer is killed all the same."""
    import ray

    refs = []
    for actor in actors:
        try:
            refs.append(actor.shutdown.remote())
        except Exception:  # a handle to a dead actor: nothing to close
            continue
    if refs:
        ray.wait(refs, num_returns=len(refs), timeout=grace_s)
    for actor in actors:
        ray_kill(actor)


def stop(args: argparse.Namespace) -> int:
    """``kvroute stop``: ends every named replica (front doors then find none and fail
    their requests with 503 until replicas are started again), and the fleet's LoRA
    registry (the next fleet starts from its replicas' ``--lora-modules``)."""
    import ray

    from kvroute.router.lora.shared import LORA_REGISTRY_ACTOR

    ray.init(address=args.address, namespace=args.namespace, logging_level="warning")
    try:
        named = ray.util.list_named_actors()
        names = [n for n in named if n.startswith(REPLICA_ACTOR_PREFIX)]
        # each replica closes its engine first (its KV disk folder goes), then is killed
        stop_replicas([ray.get_actor(name) for name in names])
        for name in [n for n in named if n == LORA_REGISTRY_ACTOR]:
            ray.kill(ray.get_actor(name), no_restart=True)
        print(f"kvroute stop: stopped {len(names)} replica(s) in namespace {args.namespace!r}",
              file=sys.stderr)  # fmt: skip
        return 0
    finally:
        ray.shutdown()
