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

This module holds the pools' flags and the rules (:func:`refusal`); :func:`.scale.resize_pools`
resizes the pools by them.
"""

from __future__ import annotations

import argparse

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


def refusal(
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
