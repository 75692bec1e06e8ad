"""Retiring replicas from a running fleet (``kvroute scale`` down, the autoscaler's
shrink): drain, then stop.

Why apart from :mod:`.scale`: growing and retiring share only the fleet's list; retiring
is its own protocol with the front doors. A replica not running yet has served nothing and
is stopped at once. The others are drained together: routers see ``draining`` at their
next poll and send them nothing new; a replica is stopped once nothing runs there and no
request has reached it for ``SETTLE_S`` (a front door that had not yet read ``draining``
resets that clock), or after the drain's timeout all the same (its requests fail over).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

from .stop import ray_kill, stop_replicas

# Routers poll each replica's info() this often (Fleet's monitor interval) ...
ROUTER_POLL_S = 2.0
# ... so a drained replica is idle for good once this long has passed since the drain.
SETTLE_S = 3 * ROUTER_POLL_S


def listed(ids: Any, most: int = 12) -> str:
    """``ids`` joined, the first ``most`` of a long list and how many more."""
    ids = list(ids)
    shown = ", ".join(ids[:most])
    return shown + (f" and {len(ids) - most} more" if len(ids) > most else "")


def shrink(
    fleet: dict[str, Any],
    ids: list[str],
    n: int,
    timeout: float,
    say: Callable[[str], None],
    infos: dict[str, Any],
    draining: Sequence[str] = (),
    quiet_s: float = SETTLE_S,
    *,
    pending: set[str] | frozenset[str] = frozenset(),
    noun: str = "replica(s)",
) -> int:
    """Retires ``len(ids) - n`` of ``ids``, and finishes off ``draining`` (left so)."""
    retired = _retirees(ids, n, infos) if n < len(ids) else []
    retired += [rid for rid in draining if rid not in retired]
    now = [rid for rid in retired if rid in pending]  # nothing runs there: no drain
    for rid in now:
        ray_kill(fleet[rid])
    if now:
        say(f"stopped {len(now)} replica(s) not running yet: {listed(now)}")
    drained = [rid for rid in retired if rid not in pending]
    if drained:
        _drain(fleet, drained, timeout, say, quiet_s)
    kept = [rid for rid in ids if rid not in retired]
    say(f"{len(kept)} {noun}: {listed(kept)}")
    return 0


def _drain(
    fleet: dict[str, Any],
    retired: list[str],
    timeout: float,
    say: Callable[[str], None],
    quiet_s: float,
) -> None:
    """Drains ``retired`` together, waits until each is idle (or ``timeout``), kills them."""
    say(f"draining {listed(retired)} ...")
    done = _succeeded({rid: fleet[rid].drain.remote() for rid in retired}, 30)
    for rid in retired:
        if rid not in done:  # dead already (nothing runs there), or stuck: not waited for
            say(f"replica {rid} does not answer its drain: stopping it")
    # Stopped once nothing runs there and no request has arrived for quiet_s: every front
    # door has read `draining` by then, and one that had not would have reset the clock.
    t0 = time.monotonic()
    quiet: dict[str, tuple[int, float]] = {}  # rid -> (requests received, since when)
    busy = set(done)
    while busy and time.monotonic() - t0 < timeout:
        statuses = _drain_statuses({rid: fleet[rid] for rid in busy})
        now = time.monotonic()
        for rid, status in statuses.items():
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
    stop_replicas([fleet[rid] for rid in retired])
    for rid in retired:
        say(f"replica {rid} stopped")


def _succeeded(refs: dict[str, Any], timeout_s: float) -> set[str]:
    """The keys of ``refs`` whose Ray call returned (whatever it returned, None too) within
    ``timeout_s``, asked together."""
    import ray

    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    done, ok = set(ready), set()
    for key, ref in refs.items():
        if ref in done:
            with contextlib.suppress(Exception):
                ray.get(ref)
                ok.add(key)
    return ok


def _retirees(ids: list[str], n: int, infos: dict[str, Any]) -> list[str]:
    """The ``len(ids) - n`` replicas to retire: those that did not answer (``infos``: None;
    failed, restarting, still loading) first, then the highest ids."""
    order = [rid for rid in ids if infos.get(rid) is None]
    order += [rid for rid in reversed(ids) if infos.get(rid) is not None]
    return sorted(order[: len(ids) - n], key=ids.index)


def _drain_statuses(actors: dict[str, Any], timeout_s: float = 10) -> dict[str, Any]:
    """(ongoing, received) of each draining replica, asked together; None where it is
    gone. One that does not answer in time counts as busy (it may be mid-step)."""
    import ray

    refs = {rid: a.drain_status.remote() for rid, a in actors.items()}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    done = set(ready)
    out: dict[str, Any] = {}
    for rid, ref in refs.items():
        if ref not in done:
            out[rid] = (1, -1)
            continue
        try:
            out[rid] = tuple(ray.get(ref))
        except Exception:
            out[rid] = None
    return out
