"""``kvroute scale --replicas N``: grow or shrink a running fleet, with no restart.

Why here and not in the front door: replicas are Ray actors named ``replica-<id>`` in the
fleet's namespace, and every front door (``kvroute serve``'s, each ``kvroute router``)
reads that list every few seconds (:class:`kvroute.router.membership.Membership`). So a
replica started anywhere under that name joins every front door: it is given the fleet's
LoRA adapters, then routed to; and one whose actor is gone leaves them. This command only
starts and retires actors.

- Up: each new replica is a twin of a running one (its engine configuration and Ray
  options, :meth:`~kvroute.replica.actor.ReplicaServer.launch_spec`), named with the
  smallest free ``r<i>``, detached (it outlives this command, as ``kvroute serve
  --address`` starts them; ``kvroute stop`` ends them). On a Ray cluster with an
  autoscaler, its GPU request brings up a node.
- Down: the replicas that do not answer, then those with the highest ids, are drained
  (routers see ``draining`` at their next poll and send them nothing new), their running
  requests end, and only then are they killed: a replica is stopped once nothing runs
  there and no request has reached it for ``SETTLE_S`` (a front door that had not yet
  read ``draining`` resets that clock). One
  still busy after ``--drain-timeout`` is stopped anyway: its requests fail over as after
  any replica's loss (continued elsewhere, within the front doors' retry bounds).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from .router import RAY_NAMESPACE, REPLICA_ACTOR_PREFIX, answers, named_replicas

# Routers poll each replica's info() this often (Fleet's monitor interval) ...
ROUTER_POLL_S = 2.0
# ... so a drained replica is idle for good once this long has passed since the drain.
SETTLE_S = 3 * ROUTER_POLL_S


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, required=True, help="the fleet's new size (>= 1)")
    p.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")
    p.add_argument("--namespace", default=RAY_NAMESPACE, help="where the replicas are named")
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=300.0,
        help="seconds a retired replica's running requests get to end before it is killed "
        "(they fail over then; default: 300)",
    )
    p.add_argument(
        "--drain-quiet",
        type=float,
        default=SETTLE_S,
        help="seconds a retiring replica must go without running or receiving a request "
        f"before it is stopped (default: {SETTLE_S:g}; at least a few front-door polls, 2 s "
        "each)",
    )
    p.add_argument(
        "--ready-timeout",
        type=float,
        default=900.0,
        help="seconds new replicas get to load their model (default: 900)",
    )


def _say(msg: str) -> None:
    print(f"kvroute scale: {msg}", file=sys.stderr, flush=True)


def _free_ids(taken: set[str], n: int) -> list[str]:
    out, i = [], 0
    while len(out) < n:
        if f"r{i}" not in taken:
            out.append(f"r{i}")
        i += 1
    return out


def run(args: argparse.Namespace) -> int:
    if args.replicas < 1:
        _say("--replicas must be >= 1 (kvroute stop ends a fleet)")
        return 2
    import ray

    try:
        ray.init(address=args.address, namespace=args.namespace, logging_level="warning")
    except ConnectionError as exc:
        _say(f"{exc}; kvroute serve prints the address to give (and, on its own local Ray, "
             "RAY_AUTH_MODE=token: its token is in ~/.ray/auth_token)")  # fmt: skip
        return 1
    try:
        return resize(args.replicas, args.ready_timeout, args.drain_timeout, _say, args.drain_quiet)
    finally:
        ray.shutdown()


def resize(
    n: int,
    ready_timeout: float,
    drain_timeout: float,
    say: Callable[[str], None],
    quiet_s: float = SETTLE_S,
) -> int:
    """The fleet on this driver's Ray made ``n`` replicas (module docstring); an exit code."""
    import ray

    fleet = named_replicas()
    if not fleet:
        say("no replicas in this namespace: start a fleet with kvroute serve")
        return 1
    # Replicas left draining (a scale interrupted mid-drain) are not the fleet's: a grow
    # takes them back first (no model to load), a shrink finishes them off.
    infos = answers({rid: a.info.remote() for rid, a in fleet.items()}, 10)
    draining = [rid for rid, info in infos.items() if info is not None and info.draining]
    ids = [rid for rid in fleet if rid not in draining]
    while n > len(ids) and draining:
        rid = draining.pop(0)
        ray.get(fleet[rid].undrain.remote(), timeout=30)
        ids = sorted([*ids, rid], key=list(fleet).index)
        say(f"replica {rid} was left draining: taken back")
    if n > len(ids):
        return _grow(fleet, ids, n, ready_timeout, say)
    if n < len(ids) or draining:
        return _shrink(fleet, ids, n, drain_timeout, say, infos, draining, quiet_s)
    say(f"the fleet already has {len(ids)} replica(s): {', '.join(ids)}")
    return 0


def _grow(
    fleet: dict[str, Any], ids: list[str], n: int, timeout: float, say: Callable[[str], None]
) -> int:
    import ray

    spec = None
    for rid in ids:  # the first that answers is the template
        try:
            spec = ray.get(fleet[rid].launch_spec.remote(), timeout=30)
            break
        except Exception as exc:  # dead, or a replica from before launch_spec
            say(f"replica {rid} cannot describe its start ({type(exc).__name__}); next")
    if spec is None:
        say("no running replica could say how it was started")
        return 1
    say(f"starting {n - len(ids)} replica(s) like {spec.replica_id} ...")
    started: dict[str, Any] = {}
    taken = set(fleet)
    while len(started) < n - len(ids):
        rid = _free_ids(taken, 1)[0]
        taken.add(rid)
        try:  # detached: they outlive this command (on serve's own local Ray, not it)
            started[rid] = spec.start(rid, REPLICA_ACTOR_PREFIX + rid, lifetime="detached")
        except ValueError:  # the name was taken meanwhile (another scale): the next one
            continue
    say(f"started {', '.join(started)}; loading the model ...")
    t0 = time.monotonic()
    pending = {actor.info.remote(): rid for rid, actor in started.items()}
    failed = 0
    while pending:
        left = timeout - (time.monotonic() - t0)
        if left <= 0:
            say(f"not ready after {timeout:g} s, stopped: {', '.join(pending.values())}")
            for rid in pending.values():
                ray.kill(started[rid], no_restart=True)
            return 1
        done, _ = ray.wait(list(pending), num_returns=1, timeout=min(left, 15))
        for ref in done:
            rid = pending.pop(ref)
            try:
                ray.get(ref)
                say(f"replica {rid} ready after {time.monotonic() - t0:.0f} s")
            except Exception as exc:
                failed += 1
                say(f"replica {rid} failed to start: {type(exc).__name__}: {exc}")
                ray.kill(started[rid], no_restart=True)
        if not done:
            short = _short_of(spec.options)
            say(f"... {len(started) - len(pending)}/{len(started)} ready" + (
                f"; each needs {short}: a Ray autoscaler adds a node for it, a local "
                "kvroute serve has only its own machine's" if short else ""
            ))  # fmt: skip
    if failed:
        return 1
    say(f"{len(ids) + len(started)} replicas; front doors route to the new ones within seconds")
    return 0


def _shrink(
    fleet: dict[str, Any],
    ids: list[str],
    n: int,
    timeout: float,
    say: Callable[[str], None],
    infos: dict[str, Any],
    draining: Sequence[str] = (),
    quiet_s: float = SETTLE_S,
) -> int:
    """Retires ``len(ids) - n`` of ``ids``, and finishes off ``draining`` (left so)."""
    import ray

    retired = _retirees(ids, n, infos) if n < len(ids) else []
    retired += [rid for rid in draining if rid not in retired]
    say(f"draining {', '.join(retired)} ...")
    for rid in retired:
        try:
            ray.get(fleet[rid].drain.remote(), timeout=30)
        except Exception as exc:  # dead already: nothing runs there
            say(f"replica {rid} does not answer ({type(exc).__name__}): stopping it")
    # Stopped once nothing runs there and no request has arrived for quiet_s: every front
    # door has read `draining` by then, and one that had not would have reset the clock.
    t0 = time.monotonic()
    quiet: dict[str, tuple[int, float]] = {}  # rid -> (requests received, since when)
    busy = set(retired)
    while busy and time.monotonic() - t0 < timeout:
        for rid in sorted(busy):
            status = _drain_status(fleet[rid])
            now = time.monotonic()
            if status is None:  # gone: nothing to wait for
                busy.discard(rid)
                continue
            ongoing, received = status
            if quiet.get(rid, (None, 0.0))[0] != received:
                quiet[rid] = (received, now)
            if ongoing == 0 and now - quiet[rid][1] >= quiet_s:
                busy.discard(rid)
        if busy:
            time.sleep(0.5)
    if busy:
        say(f"still busy after {timeout:g} s: {', '.join(sorted(busy))}; their "
            "requests fail over")  # fmt: skip
    for rid in retired:
        ray.kill(fleet[rid], no_restart=True)
        say(f"replica {rid} stopped")
    kept = [rid for rid in ids if rid not in retired]
    say(f"{len(kept)} replica(s): {', '.join(kept)}")
    return 0


def _retirees(ids: list[str], n: int, infos: dict[str, Any]) -> list[str]:
    """The ``len(ids) - n`` replicas to retire: those that did not answer (``infos``: None;
    failed, restarting, still loading) first, then the highest ids."""
    order = [rid for rid in ids if infos.get(rid) is None]
    order += [rid for rid in reversed(ids) if infos.get(rid) is not None]
    return sorted(order[: len(ids) - n], key=ids.index)


def _drain_status(actor: Any) -> tuple[int, int] | None:
    """(ongoing, received) of a draining replica; None when it is gone. One that does not
    answer in time counts as busy (it may be mid-step under load)."""
    import ray

    try:
        return tuple(ray.get(actor.drain_status.remote(), timeout=10))  # type: ignore[return-value]
    except ray.exceptions.GetTimeoutError:
        return (1, -1)
    except Exception:
        return None


def _short_of(options: dict[str, Any]) -> str:
    """What a replica started with ``options`` needs and the cluster has not free now
    ('' when it has it all: the replicas are loading their model)."""
    import ray

    need = {"CPU": options.get("num_cpus", 1), "GPU": options.get("num_gpus", 0)}
    need.update(options.get("resources") or {})
    free = ray.available_resources()
    return ", ".join(
        f"{k} {v:g} ({free.get(k, 0):g} free)" for k, v in need.items() if v and free.get(k, 0) < v
    )
