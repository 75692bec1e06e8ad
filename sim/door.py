"""The front door's flow control, simulated: requests wait at the door until a replica has
room, and are then routed among the replicas that have it (router/fleet/flow.py's rule).

Why model it: with flow control on, what a late request waits behind is the door's queue,
not a replica's, and the router chooses among fewer replicas (those with room) at a later
moment (the index's view at dispatch). Both change hit rate and goodput; the simulator
must show whether routing quality holds (issue 53).

Room, as live: a replica has room while the requests the door sent it that have no first
token yet are fewer than ``depth`` and their prompt tokens fewer than ``tokens`` (None: no
bound, the live default); an empty one always has room. Order: first come first served
(the live door's bands and per-tenant counters are not modelled: a simulated workload
has no priorities, and its tenants share one band). A request whose replicas all lack
room waits; the head of the queue is looked at again whenever a slot is given back, so
the door is work-conserving.

Invariants: ``pending[r]`` is the number of requests in ``holding`` on replica ``r``, and
``pending_tokens[r]`` the sum of their tokens; a request holds at most one slot.
"""

from __future__ import annotations

from collections import deque
from typing import Any


class Door:
    """The door's slots per replica and its queue of waiting requests (any payload)."""

    def __init__(self, depth: int, tokens: int | None = None) -> None:
        if depth < 1 or (tokens is not None and tokens < 1):
            raise ValueError("flow control needs a depth (and a token bound, if any) >= 1")
        self.depth, self.tokens = depth, tokens
        self.pending: dict[str, int] = {}
        self.pending_tokens: dict[str, int] = {}
        self.holding: dict[int, tuple[str, int]] = {}  # request idx -> (replica, tokens)
        self.waiting: deque[Any] = deque()
        self.num_waited = 0  # requests that waited at the door at least once

    def has_room(self, replica: str) -> bool:
        n = self.pending.get(replica, 0)
        if n == 0 or self.tokens is None:
            return n < self.depth
        return n < self.depth and self.pending_tokens.get(replica, 0) < self.tokens

    def room(self, candidates: list[str]) -> list[str]:
        return [r for r in candidates if self.has_room(r)]

    def occupy(self, idx: int, replica: str, tokens: int) -> None:
        self.vacate(idx)
        self.holding[idx] = (replica, tokens)
        self.pending[replica] = self.pending.get(replica, 0) + 1
        self.pending_tokens[replica] = self.pending_tokens.get(replica, 0) + tokens

    def vacate(self, idx: int) -> bool:
        """Request ``idx`` got its first token, or left its replica: True if it held a
        slot (the queue may move)."""
        held = self.holding.pop(idx, None)
        if held is None:
            return False
        replica, tokens = held
        self.pending[replica] -= 1
        self.pending_tokens[replica] -= tokens
        return True

    def check_invariants(self) -> None:
        count: dict[str, int] = {}
        toks: dict[str, int] = {}
        for replica, tokens in self.holding.values():
            count[replica] = count.get(replica, 0) + 1
            toks[replica] = toks.get(replica, 0) + tokens
        assert {r: n for r, n in self.pending.items() if n} == count
        assert {r: n for r, n in self.pending_tokens.items() if n} == {
            r: t for r, t in toks.items() if t
        }
