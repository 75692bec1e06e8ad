"""``kvroute scale --replicas N``: grow or shrink a running fleet, with no restart.

Why here and not in the front door: replicas are Ray actors named ``replica-<id>`` in the
fleet's namespace, and every front door (``kvroute serve``'s, each ``kvroute router``)
reads that list every few seconds (:class:`kvroute.router.fleet.membership.Membership`). So a
replica started anywhere under that name joins every front door: it is given the fleet's
LoRA adapters, then routed to; and one whose actor is gone leaves them. This command only
starts and retires actors.

- Up: each new replica is a twin of a running one (its engine configuration and Ray
  options, :meth:`~kvroute.replica.serve.actor.ReplicaServer.launch_spec`), named with the
  smallest free ``r<i>``, detached (it outlives this command, as ``kvroute serve
  --address`` starts them; ``kvroute stop`` ends them). A size the cluster cannot hold is
  refused before any starts (:mod:`.capacity`: an autoscaler's limit counts, and
  ``--wait-for-resources`` waits for nodes anyway). They start in batches (``BATCH``, or
  as many as fit now), each ready before the next, so at most a batch ever waits for
  resources; a grow interrupted (Ctrl-C, SIGTERM) or timed out stops the ones it started
  that are not ready, so none is left waiting.
- Down: the replicas that do not answer, then those with the highest ids, retire. One not
  running yet (waiting for resources, loading its model, restarting) has served nothing:
  it is killed at once. The others are drained, together (routers see ``draining`` at
  their next poll and send them nothing new), their running requests end, and only then
  are they killed: a replica is stopped once nothing runs there and no request has
  reached it for ``SETTLE_S`` (a front door that had not yet read ``draining`` resets
  that clock). One still busy after ``--drain-timeout`` is stopped anyway: its requests
  fail over as after any replica's loss (continued elsewhere, within the front doors'
  retry bounds).
- A P/D fleet (replicas with roles): each pool on its own (:func:`resize_pools`, by the
  rules of :mod:`.scale_roles`).

``kvroute stop`` (:mod:`.stop`) ends the whole fleet, which a scale refuses.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from .capacity import BATCH, need_of, not_running, room_for
from .retire import SETTLE_S, listed, shrink
from .router import RAY_NAMESPACE, REPLICA_ACTOR_PREFIX, answers, named_replicas
from .scale_roles import NOUN, ROLES, add_role_arguments, asked_pools, check_pools, refusal
from .stop import ray_kill


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="the fleet's new size (>= 1); on a P/D fleet, its whole-request (role both) "
        "replicas' (>= 0)",
    )
    add_role_arguments(p)
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
        help="seconds each batch of new replicas gets to be placed and load its model; "
        "those not ready then are stopped (default: 900)",
    )
    p.add_argument(
        "--wait-for-resources",
        action="store_true",
        help="grow past what the cluster holds now (and past its autoscaler's known "
        "limit): the new replicas wait, a batch at a time, for nodes that are coming",
    )


def _say(msg: str) -> None:
    print(f"kvroute scale: {msg}", file=sys.stderr, flush=True)


def check_arguments(args: argparse.Namespace) -> str | None:
    """What is wrong with ``kvroute scale``'s flags (None: nothing), before Ray."""
    pools = asked_pools(args)
    if not pools:
        return "give the new size: --replicas N, or --prefill-replicas/--decode-replicas"
    if set(pools) == {"both"} and args.replicas < 1:
        return "--replicas must be >= 1 (kvroute stop ends a fleet)"
    if why := check_pools(pools):
        return why
    if not args.ready_timeout > 0:
        return "--ready-timeout must be > 0"
    if not args.drain_timeout >= 0 or not args.drain_quiet >= 0:
        return "--drain-timeout and --drain-quiet must be >= 0"
    return None


def _free_ids(taken: set[str], n: int) -> list[str]:
    out, i = [], 0
    while len(out) < n:
        if f"r{i}" not in taken:
            out.append(f"r{i}")
        i += 1
    return out


def _interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM as Ctrl-C: the grow's cleanup runs either way


def run(args: argparse.Namespace) -> int:
    if why := check_arguments(args):
        _say(why)
        return 2
    import ray

    previous = signal.getsignal(signal.SIGTERM)
    try:
        try:
            ray.init(address=args.address, namespace=args.namespace, logging_level="warning")
        except ConnectionError as exc:
            _say(f"{exc}; kvroute serve prints the address to give (and, on its own local "
                 "Ray, RAY_AUTH_MODE=token: its token is in ~/.ray/auth_token)")  # fmt: skip
            return 1
        signal.signal(signal.SIGTERM, _interrupted)  # after ray.init, which sets its own
        pools = asked_pools(args)
        if set(pools) != {"both"}:  # a P/D fleet's pools (scale_roles.py)
            return resize_pools(
                pools, args.ready_timeout, args.drain_timeout, _say, args.drain_quiet,
                wait_for_resources=args.wait_for_resources,
            )  # fmt: skip
        return resize(
            args.replicas,
            args.ready_timeout,
            args.drain_timeout,
            _say,
            args.drain_quiet,
            wait_for_resources=args.wait_for_resources,
        )
    except KeyboardInterrupt:
        _say("interrupted")
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous or signal.SIG_DFL)
        ray.shutdown()


def resize(
    n: int,
    ready_timeout: float,
    drain_timeout: float,
    say: Callable[[str], None],
    quiet_s: float = SETTLE_S,
    *,
    wait_for_resources: bool = False,
    stop: threading.Event | None = None,
) -> int:
    """The fleet on this driver's Ray made ``n`` replicas (module docstring); an exit code.
    ``stop`` (set): a grow under way gives up, stopping the replicas not ready yet."""
    import ray

    fleet = named_replicas()
    if not fleet:
        say("no replicas in this namespace: start a fleet with kvroute serve")
        return 1
    infos, pending = _infos(fleet)
    if any(info is not None and info.role != "both" for info in infos.values()):
        return resize_pools(  # a P/D fleet: n is its `both` pool's size
            {"both": n}, ready_timeout, drain_timeout, say, quiet_s,
            wait_for_resources=wait_for_resources, stop=stop, read=(fleet, infos),
        )  # fmt: skip
    # Replicas left draining (a scale interrupted mid-drain) are not the fleet's: a grow
    # takes them back first (no model to load), a shrink finishes them off.
    draining = [rid for rid, info in infos.items() if info is not None and info.draining]
    ids = [rid for rid in fleet if rid not in draining]
    while n > len(ids) and draining:
        rid = draining.pop(0)
        ray.get(fleet[rid].undrain.remote(), timeout=30)
        ids = sorted([*ids, rid], key=list(fleet).index)
        say(f"replica {rid} was left draining: taken back")
    if n > len(ids):
        return _grow(fleet, ids, n, ready_timeout, say, infos, wait_for_resources, stop)
    if n < len(ids) or draining:
        return shrink(fleet, ids, n, drain_timeout, say, infos, draining, quiet_s, pending=pending)
    say(f"the fleet already has {len(ids)} replica(s): {', '.join(ids)}")
    return 0


def resize_pools(
    want: dict[str, int],
    ready_timeout: float,
    drain_timeout: float,
    say: Callable[[str], None],
    quiet_s: float,
    *,
    wait_for_resources: bool = False,
    stop: threading.Event | None = None,
    read: tuple[dict[str, Any], dict[str, Any]] | None = None,
) -> int:
    """The fleet on this driver's Ray with each pool in ``want`` (role -> size) resized
    (:mod:`.scale_roles`); an exit code: 2 when refused (nothing started or stopped).
    ``read``: the fleet and its replicas' infos, already read (None: not running)."""
    import ray

    if read is None:
        fleet = named_replicas()
        if not fleet:
            say("no replicas in this namespace: start a fleet with kvroute serve")
            return 1
        infos, _ = _infos(fleet)
    else:
        fleet, infos = read
    role_of = {rid: info.role for rid, info in infos.items() if info is not None}
    if unknown := [rid for rid in fleet if rid not in role_of]:
        say(f"not answering, role unknown (left as they are): {listed(unknown)}")
    pool = {role: [rid for rid in fleet if role_of.get(rid) == role] for role in ROLES}
    live = {role: [rid for rid in ids if not infos[rid].draining] for role, ids in pool.items()}
    after = {role: want.get(role, len(live[role])) for role in ROLES}
    if why := refusal(want, after, live, pool):
        say(why)
        return 2
    specs: dict[str, Any] = {}  # a twin of a running replica per pool to grow, read first
    for role, n in want.items():
        if n > len(pool[role]):  # more than taking back its drained ones gives
            specs[role] = template({rid: fleet[rid] for rid in pool[role]}, infos, say)
            if specs[role] is None:
                return 1
    order = sorted(want, key=lambda role: want[role] > len(live[role]))  # shrinks first
    for role in order:
        ids, n = list(live[role]), want[role]
        draining = [rid for rid in pool[role] if rid not in ids]
        while n > len(ids) and draining:  # as scale.resize: a drained one is taken back
            rid = draining.pop(0)
            ray.get(fleet[rid].undrain.remote(), timeout=30)
            ids = sorted([*ids, rid], key=list(fleet).index)
            say(f"replica {rid} ({role}) was left draining: taken back")
        if n > len(ids):
            say(f"{role} pool: {len(ids)} -> {n}")
            code = _grow(
                fleet, ids, n, ready_timeout, say, infos, wait_for_resources, stop,
                spec=specs[role], noun=NOUN[role],
            )  # fmt: skip
        elif n < len(ids) or draining:
            say(f"{role} pool: {len(ids)} -> {n}")
            code = shrink(
                fleet, ids, n, drain_timeout, say, infos, draining, quiet_s, noun=NOUN[role]
            )
        else:
            say(f"the {role} pool already has {n}: {listed(ids) or 'none'}")
            code = 0
        if code:
            return code
    return 0


def _infos(fleet: dict[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """Each replica's info (None: not running, so not asked, or no answer), and the ones
    not running. Only running actors are asked: a call to one waiting for resources would
    wait too."""
    pending = not_running(fleet)
    infos = answers({rid: a.info.remote() for rid, a in fleet.items() if rid not in pending}, 10)
    infos.update(dict.fromkeys(pending))
    return infos, pending


def template(
    fleet: dict[str, Any], infos: dict[str, Any], say: Callable[[str], None]
) -> Any | None:
    """The launch spec of a running replica (the first in id order that answers), which a
    new one copies; None: none could say how it was started."""
    asked = [rid for rid in fleet if infos.get(rid) is not None]
    if not asked:
        say("no replica is running to copy (each is waiting, loading or not answering)")
        return None
    specs = answers({rid: fleet[rid].launch_spec.remote() for rid in asked}, 30)
    for rid, spec in specs.items():
        if spec is not None:
            return spec
        say(f"replica {rid} cannot describe its start (a replica from before launch_spec?)")
    say("no running replica could say how it was started")
    return None


def _grow(
    fleet: dict[str, Any],
    ids: list[str],
    n: int,
    timeout: float,
    say: Callable[[str], None],
    infos: dict[str, Any],
    wait_for_resources: bool = False,
    stop: threading.Event | None = None,
    spec: Any = None,
    noun: str = "replicas",
) -> int:
    """Grows ``ids`` (of ``fleet``: all its names are taken) to ``n`` twins of ``spec``
    (None: of the first running replica in ``fleet``)."""
    spec = spec or template(fleet, infos, say)
    if spec is None:
        return 1
    need = need_of(spec.options)
    more = n - len(ids)
    room = room_for(need)
    why = room.refusal(more)
    if why and not wait_for_resources:
        say(why)
        return 1
    say(f"starting {more} replica(s) like {spec.replica_id} ...")
    taken = set(fleet)
    ready: list[str] = []
    starting: dict[str, Any] = {}  # started, not ready: stopped if this grow ends early
    try:
        while len(ready) < more:
            if ready:  # nodes may have come (or gone) meanwhile
                room = room_for(need)
            size = min(more - len(ready), max(BATCH, room.now or 0))
            while len(starting) < size:
                rid = _free_ids(taken, 1)[0]
                taken.add(rid)
                try:  # detached: they outlive this command (on serve's own Ray, not it)
                    starting[rid] = spec.start(rid, REPLICA_ACTOR_PREFIX + rid, lifetime="detached")
                except ValueError:  # the name was taken meanwhile (another scale): the next
                    continue
            say(f"started {', '.join(starting)}; loading the model ...")
            if not _await_ready(starting, ready, timeout, say, spec.options, stop):
                return 1
    finally:
        if starting:  # interrupted, timed out or failed: none is left waiting
            with _uninterrupted():
                for actor in starting.values():
                    with contextlib.suppress(Exception):
                        ray_kill(actor)
            say(f"stopped {len(starting)} replica(s) not ready: {listed(starting)}")
    say(f"{len(ids) + len(ready)} {noun}; front doors route to the new ones within seconds")
    return 0


def _await_ready(
    starting: dict[str, Any],
    ready: list[str],
    timeout: float,
    say: Callable[[str], None],
    options: dict[str, Any],
    stop: threading.Event | None,
) -> bool:
    """Waits until every replica in ``starting`` is ready (moved to ``ready``); False when
    one failed, ``timeout`` passed or ``stop`` was set (the rest stay in ``starting``)."""
    import ray

    t0 = said = time.monotonic()
    waiting = {actor.info.remote(): rid for rid, actor in starting.items()}
    failed = 0
    while waiting:
        left = timeout - (time.monotonic() - t0)
        if left <= 0:
            say(f"not ready after {timeout:g} s: {listed(waiting.values())}")
            return False
        if stop is not None and stop.is_set():
            return False
        # Short waits: Ctrl-C, SIGTERM and ``stop`` are seen within 2 s.
        done, _ = ray.wait(list(waiting), num_returns=1, timeout=min(left, 2))
        for ref in done:
            rid = waiting.pop(ref)
            try:
                ray.get(ref)
            except Exception as exc:
                failed += 1
                say(f"replica {rid} failed to start: {type(exc).__name__}: {exc}")
                continue  # still in starting: stopped with the rest
            ready.append(rid)
            del starting[rid]
            say(f"replica {rid} ready after {time.monotonic() - t0:.0f} s")
        if not done and time.monotonic() - said >= 14.5:  # a line every 15 s of waiting
            said = time.monotonic()
            short = _short_of(options)
            say(f"... {len(ready)} ready, {len(waiting)} loading" + (
                f"; each needs {short}: a Ray autoscaler adds a node for it, a local "
                "kvroute serve has only its own machine's" if short else ""
            ))  # fmt: skip
    return failed == 0


@contextlib.contextmanager
def _uninterrupted() -> Iterator[None]:
    """Ctrl-C and SIGTERM held off (on the main thread) while a cleanup runs: a second
    Ctrl-C must not leave half the not-ready replicas behind."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in held.items():
            signal.signal(s, handler)


def _short_of(options: dict[str, Any]) -> str:
    """What a replica started with ``options`` needs and the cluster has not free now
    ('' when it has it all: the replicas are loading their model)."""
    import ray

    need = need_of(options)
    free = ray.available_resources()
    return ", ".join(
        f"{k} {v:g} ({free.get(k, 0):g} free)" for k, v in need.items() if free.get(k, 0) < v
    )
