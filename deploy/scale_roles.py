"""``kvroute scale --prefill-replicas N --decode-replicas M``: a P/D fleet's pools, each
resized on its own (docs/disaggregation.md).

Why pools and not one size: a prefill replica and a decode replica are not
interchangeable (their engines' ``role`` differs), so a fleet started with ``kvroute serve
--prefill-replicas P --decode-replicas D [--replicas K]`` is three pools, and each is
sized by :mod:`.scale`'s own grow and shrink with only its replicas in view: a new replica
is a twin of a running one *of its role* (its launch spec carries the role in its engine
configuration), and a shrink retires only replicas of its role (the highest ids first).
A replica's role is ``ReplicaInfo.role`` from its ``info()``. ``--replicas`` on a fleet
with roles sizes its ``both`` (whole-request) pool.

Everything that would be refused is refused before any replica starts or stops: a pool
to grow with no running replica to copy, a prefill or decode pool shrunk to 0 while the
other keeps replicas (a P/D fleet needs both pools, or neither), a fleet left empty.
Shrinks run before grows, so a pool's retired replicas make room for another's new ones.
Replicas that do not answer (waiting for resources, loading, restarting) have no known
role: they are left as they are, and said.
"""

from __future__ import annotations

import argparse
import threading
from collections.abc import Callable
from typing import Any

ROLES = ("prefill", "decode", "both")
FLAG = {"prefill": "--prefill-replicas", "decode": "--decode-replicas", "both": "--replicas"}
NOUN = {
    "prefill": "prefill replica(s)",
    "decode": "decode replica(s)",
    "both": "whole-request replica(s)",
}
HOW = "start the fleet with kvroute serve --prefill-replicas P --decode-replicas D"


def add_role_arguments(p: argparse.ArgumentParser) -> None:
    """``kvroute scale``'s P/D flags (beside or instead of ``--replicas``)."""
    p.add_argument(
        "--prefill-replicas",
        type=int,
        default=None,
        metavar="N",
        help="P/D: the prefill pool's new size (new ones copy a running prefill replica; "
        "a shrink retires prefill replicas only)",
    )
    p.add_argument(
        "--decode-replicas",
        type=int,
        default=None,
        metavar="M",
        help="P/D: the decode pool's new size (as --prefill-replicas, for decode replicas)",
    )


def asked_pools(args: argparse.Namespace) -> dict[str, int]:
    """The pools the flags size: role -> new size (``--replicas``: ``both``)."""
    given = {
        "prefill": getattr(args, "prefill_replicas", None),
        "decode": getattr(args, "decode_replicas", None),
        "both": getattr(args, "replicas", None),
    }
    return {role: n for role, n in given.items() if n is not None}


def check_pools(pools: dict[str, int]) -> str | None:
    """What is wrong with the pools' sizes on their own (before Ray); None: nothing."""
    for role, n in pools.items():
        if n < 0:
            return f"{FLAG[role]} must be >= 0"
    if why := _lopsided(pools.get("prefill"), pools.get("decode")):
        return why
    if set(pools) == set(ROLES) and not any(pools.values()):
        return "every pool 0 leaves no replica: kvroute stop ends a fleet"
    return None


def _lopsided(p: int | None, d: int | None) -> str | None:
    """Why a prefill pool of ``p`` beside a decode pool of ``d`` cannot be (one is 0, the
    other not: requests would be prefilled with no decode replica to hand them to, or no
    request would split at all); None: fine, or a size not known."""
    if p is None or d is None or (p == 0) == (d == 0):
        return None
    if p == 0:
        left = f"--prefill-replicas 0 would leave {d} decode replica(s) and no prefill one"
    else:
        left = f"--decode-replicas 0 would leave {p} prefill replica(s) and no decode one"
    return (
        f"{left}: a P/D fleet needs both pools or neither; to end P/D give both "
        "--prefill-replicas 0 --decode-replicas 0 (the --replicas ones then serve all)"
    )


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
    (module docstring); an exit code: 2 when refused (nothing started or stopped).
    ``read``: the fleet and its replicas' infos, already read (None: not running)."""
    import ray

    from .scale import _grow, _listed, _shrink, template

    if read is None:
        fleet, infos = _read()
        if not fleet:
            say("no replicas in this namespace: start a fleet with kvroute serve")
            return 1
    else:
        fleet, infos = read
    role_of = {rid: info.role for rid, info in infos.items() if info is not None}
    if unknown := [rid for rid in fleet if rid not in role_of]:
        say(f"not answering, role unknown (left as they are): {_listed(unknown)}")
    pool = {role: [rid for rid in fleet if role_of.get(rid) == role] for role in ROLES}
    live = {role: [rid for rid in ids if not infos[rid].draining] for role, ids in pool.items()}
    after = {role: want.get(role, len(live[role])) for role in ROLES}
    if why := _refusal(want, after, live, pool):
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
            code = _shrink(
                fleet, ids, n, drain_timeout, say, infos, draining, quiet_s, noun=NOUN[role]
            )
        else:
            say(f"the {role} pool already has {n}: {_listed(ids) or 'none'}")
            code = 0
        if code:
            return code
    return 0


def _read() -> tuple[dict[str, Any], dict[str, Any]]:
    """The fleet and each replica's info (None: not running, so not asked, or no answer),
    as :func:`kvroute.deploy.scale.resize` reads them."""
    from .capacity import not_running
    from .router import answers, named_replicas

    fleet = named_replicas()
    pending = not_running(fleet)
    infos = answers({rid: a.info.remote() for rid, a in fleet.items() if rid not in pending}, 10)
    infos.update(dict.fromkeys(pending))
    return fleet, infos


def _refusal(
    want: dict[str, int],
    after: dict[str, int],
    live: dict[str, list[str]],
    pool: dict[str, list[str]],
) -> str | None:
    """Why these pool sizes are refused on this fleet (one line), None: they are not."""
    for role, n in want.items():
        if n > len(pool[role]) and not pool[role]:
            if role == "both":
                how = HOW + " --replicas K (whole-request ones beside them)"
            elif not pool["prefill"] and not pool["decode"]:
                how = "this fleet has no P/D roles; " + HOW
            else:
                how = HOW
            return f"{FLAG[role]} {n}: no running {NOUN[role][:-3]} to copy; {how}"
    for role, other in (("prefill", "decode"), ("decode", "prefill")):
        if role in want and live[role] and after[role] == 0 and after[other]:
            return _lopsided(after["prefill"], after["decode"])
    if not any(after.values()) and any(live.values()):
        return "that leaves no replica: kvroute stop ends a fleet"
    return None
