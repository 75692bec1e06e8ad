"""Flow control: admitted requests wait here, in the front door, until a replica has room.

Why: without it every admitted request is sent to a replica at once, and a late request's
wait is decided by that replica's queue, which the front door no longer controls -- a
tenant flooding the fleet sits ahead of everyone in every engine queue, and no priority
can overtake it. Here a request waits after it is parsed and tokenized and before it is
routed, and is sent (routed then, with the index's view of that moment) only when some
replica it may go to has room. What replicas hold stays small, so what decides a late
request's wait is this queue's order, which the front door owns.

Room (the saturation signal), for a request of priority ``p`` and tenant ``t``: a replica
has room while the requests this front door sent it that have not produced their first
token there yet -- queued or prefilling in its engine -- and are of priority ``p`` or more
urgent are fewer than ``depth`` and their prompt tokens fewer than ``tokens`` (none: room,
whatever the prompt); or while ``t`` has none of those there and they are fewer than
``2 * depth`` (a light tenant's request goes in beside a flood, whose engine's fair queue
takes it next). Less urgent work never holds a request back: the engine (vLLM's priority
scheduling, kvroute's) puts it ahead. Given ``others``, the replica's latest load report's
waiting requests that are not this front door's count as well (several front doors).
Slots are kept by :meth:`FlowControl.occupy` / :meth:`vacate`, called by each
:class:`~.request_run.RequestRun`: one slot at most per run, given back at its first
token, its failover, its end. Tokens as well as requests: many short prompts share one
engine step, a few long ones fill it. A decoding request holds no slot: decode shares the
batch, and what makes a newcomer wait is the prefill queued ahead of it. Failover and P/D's
decode part are sent at once (they hold a slot like any send, but never queue): they are
requests already under way.

The waiting requests' order lives in :mod:`.bands` (its invariants there).

Dispatch order: the most urgent band first; in a band, the tenant with the least counter
(ties: the older head); in a tenant, first come first served. Only each tenant's head is
looked at; a head none of whose replicas has room is passed over for the next (so a LoRA
request waiting on its adapter's holders never holds back one any replica can take).

Invariants:
- work-conserving: after every change (a submit, a slot given back, a replica joining or
  leaving, and a sweep every ``SWEEP_S`` while anything waits), no waiting head has a
  replica with room among the replicas it may go to;
- nothing is lost or hangs: every waiter leaves exactly once -- dispatched (its future
  done, the send's own failure in it), cancelled (its client left: :meth:`cancel`), shed
  past its deadline (:class:`ShedError`), or failed when no replica it may go to is left
  (the send raises :class:`~.policy.NoReplicaError`);
- a slot is held at most once per run.

Refused early and honestly (429 with ``Retry-After``, :class:`ShedError`): a band whose
queue holds ``max_waiting`` (``queue_full``), or a request whose estimated time to its
first token would pass its deadline (``deadline``); and one still waiting when its
deadline passes. The estimate has two parts: the wait at the door (the waiters at its
priority or more urgent, over the measured drain rate) and the wait in the engine it is
sent to, ``(k + 1)`` times the engine's time per position (:meth:`slot_time`), ``k`` the
requests without a first token there that go before it. A request with a deadline is sent
only to a replica with room where that estimate meets its deadline, at its submit and
again at its turn; where none does, it is refused then rather than sent to be served late:
room is a count, and ``depth`` requests' prefill can take longer than a deadline
(``benchmarks/bench_overload.py``: with the door's wait alone counted, 97% of the admitted
requests missed at 3x capacity).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .bands import Bands, Waiter

if TYPE_CHECKING:
    from ..routing.load import LoadTracker

SWEEP_S = 0.5  # while anything waits, the queue is looked at at least this often
RATE_WINDOW_S = 10.0  # the drain rate is the dispatches of the last this many seconds
MIN_RATE_SAMPLES = 4  # fewer dispatches than this in the window: no estimate, no early shed
SLOT_SAMPLES = 64  # the per-position engine time is read from the last this many samples
# ... as their this quantile: an estimate a request is admitted on is met by most requests,
# not half of them (at overload the queue sits where the estimate just meets the deadline)
SLOT_QUANTILE = 0.9
MAX_CHARGED_OUTPUT = 512  # a request's output bound counts up to this in its tenant's counter
DEFAULT_DEPTH = 16
OTHERS_REPORT_TTL_S = 1.0  # an older load report says nothing of other front doors' requests

# No bound on prompt tokens by default: in the simulator (kvroute simulate --flow-tokens,
# 8 x h100-8b, --sweep-speed auto) 8,192 cut kv's goodput on `agents` to 0.71x (32,768:
# 0.84x) -- a hot prefix's holder, two long prompts in, lost its room and the requests went
# where they recompute -- while depth 16 alone held every workload at 1.00x (BENCHMARKS).
DEFAULT_TOKENS: int | None = None


class ShedError(Exception):
    """A request refused by flow control (the HTTP layer's 429): ``cause`` is
    ``queue_full`` or ``deadline``; ``retry_after_s`` when to try again."""

    def __init__(self, message: str, cause: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.cause = cause
        self.retry_after_s = retry_after_s

    @property
    def retry_after(self) -> str:
        """``Retry-After``'s value: whole seconds, at least 1."""
        return str(max(1, math.ceil(self.retry_after_s)))


def others_waiting(load: LoadTracker, flow: FlowControl, rid: str) -> int:
    """Requests waiting in ``rid``'s engine that are not this front door's: its fresh load
    report's waiting (``load``: the fleet's reports), less what this front door has there
    without a first token (an underestimate: some of those run already). 0 without a fresh
    report. Bound with ``functools.partial`` as a door's ``others``."""
    report, at = load.report_of(rid)
    if report is None or time.monotonic() - at > OTHERS_REPORT_TTL_S:
        return 0
    return max(0, report.num_waiting - flow.unstarted.get(rid, 0))


class Queued:
    """:meth:`FlowControl.enter`'s answer for a waiter it queued (:data:`QUEUED`)."""

    __slots__ = ()


QUEUED = Queued()


@dataclass(slots=True)
class FlowStats:
    """What /metrics shows of the queue (read at scrape time)."""

    dispatched: dict[int, int] = field(default_factory=dict)  # band -> dispatches
    shed: dict[tuple[int, str], int] = field(default_factory=dict)  # (band, cause) -> count
    cancelled: int = 0


class FlowControl:
    """The front door's queue (one per front door, on its event loop)."""

    def __init__(
        self,
        depth: int = DEFAULT_DEPTH,
        max_waiting: int | None = None,
        tokens: int | None = DEFAULT_TOKENS,
        clock: Callable[[], float] = time.monotonic,
        on_wait: Callable[[int, float], None] | None = None,
        others: Callable[[str], int] | None = None,
    ) -> None:
        """``depth``: requests without a first token this front door keeps on a replica,
        ``tokens``: their prompt tokens (both bounds hold, except on an empty replica);
        ``max_waiting``: waiters a band may hold (None: no bound); ``on_wait(band,
        seconds)``: each dispatch's wait, for /metrics; ``others(replica)``: requests
        waiting in its engine that are not this front door's (its load report's; other
        front doors'), which count against ``depth`` too."""
        if depth < 1:
            raise ValueError("flow control's depth must be >= 1")
        self.depth = depth
        self.tokens = tokens
        self.max_waiting = max_waiting
        self.clock = clock
        self.on_wait = on_wait
        self.others = others
        self.stats = FlowStats()
        self.bands = Bands()
        self.unstarted: dict[str, int] = {}  # replica -> this front door's slots held there
        # replica -> (band, tenant) -> [requests, prompt tokens]: what room is reckoned from
        self._classes: dict[str, dict[tuple[int, str], list[int]]] = {}
        self._dispatch_times: deque[float] = deque()
        # replica -> (band, tenant) -> (when sent, requests there without a first token): the
        # slots held, oldest first, for the engine's time per position (``slot_time``)
        self._sent_at: dict[str, dict[tuple[int, str], deque[tuple[float, int]]]] = {}
        self._slot_samples: deque[tuple[float, float]] = deque(maxlen=SLOT_SAMPLES)
        self._slot_cached: tuple[tuple[int, float, float], float] | None = None
        self._pumping = False
        self._again = False
        self._sweeper: asyncio.TimerHandle | None = None

    # -- room ----------------------------------------------------------------------------
    def has_room(self, replica: str, band: int = 0, tenant: str = "") -> bool:
        """Whether a request of ``band`` and ``tenant`` may be sent to ``replica`` now:
        only this front door's requests there at its priority or more urgent count (less
        urgent ones never hold it back); a tenant's first such request there may go past
        ``depth`` (up to twice it), so a light tenant is not held behind a flood the
        engine's own fair queue would let it pass."""
        n = tokens = mine = 0
        for (b, t), (count, toks) in self._classes.get(replica, {}).items():
            if b <= band:
                n += count
                tokens += toks
                if b == band and t == tenant:
                    mine += count
        if self.others is not None:
            n += self.others(replica)  # other front doors' (seen again at the sweep)
        if not n or (n < self.depth and (self.tokens is None or tokens < self.tokens)):
            return True
        return not mine and n < 2 * self.depth

    def unstarted_ahead(self, replica: str, band: int) -> int:
        """Requests on ``replica`` without a first token that go before a newcomer of
        ``band`` there: this front door's of its priority or more urgent, and others'."""
        n = sum(c for (b, _), (c, _) in self._classes.get(replica, {}).items() if b <= band)
        return n + (self.others(replica) if self.others is not None else 0)

    def occupy(self, replica: str, tokens: int = 0, band: int = 0, tenant: str = "") -> None:
        """A request of ``tokens`` prompt tokens was sent to ``replica`` and has no first
        token there yet."""
        before = self.unstarted.get(replica, 0)
        ahead = before + (self.others(replica) if self.others is not None else 0)
        sent = self._sent_at.setdefault(replica, {}).setdefault((band, tenant), deque())
        sent.append((self.clock(), ahead))
        self.unstarted[replica] = before + 1
        held = self._classes.setdefault(replica, {}).setdefault((band, tenant), [0, 0])
        held[0] += 1
        held[1] += tokens

    def vacate(self, replica: str, tokens: int = 0, band: int = 0, tenant: str = "") -> None:
        """That request got its first token there, or left it: room for the next."""
        self._sample(replica, band, tenant)
        n = self.unstarted.get(replica, 0) - 1
        if n > 0:
            self.unstarted[replica] = n
        else:
            self.unstarted.pop(replica, None)
        classes = self._classes.get(replica)
        held = classes.get((band, tenant)) if classes is not None else None
        if classes is not None and held is not None:
            held[0] -= 1
            held[1] -= tokens
            if held[0] <= 0:
                del classes[(band, tenant)]
            if not classes:
                del self._classes[replica]
        if self.waiting:
            self.pump()

    @property
    def waiting(self) -> int:
        """Requests waiting at the door, all bands."""
        return self.bands.waiting

    def lengths(self) -> dict[int, int]:
        """Waiters per band (bands that hold one)."""
        return self.bands.lengths()

    # -- the drain rate --------------------------------------------------------------------
    def drain_rate(self) -> float | None:
        """Dispatches per second over the last ``RATE_WINDOW_S`` (None: too few to say)."""
        now = self.clock()
        times = self._dispatch_times
        while times and times[0] < now - RATE_WINDOW_S:
            times.popleft()
        if len(times) < MIN_RATE_SAMPLES:
            return None
        return len(times) / max(now - times[0], 1e-3)

    def _sample(self, replica: str, band: int, tenant: str) -> None:
        """A slot given back: its time in the engine over its position there (the slots
        before it, plus its own) is one sample of the engine's time per position. Slots of
        one class on one replica are taken as given back in the order they were sent."""
        classes = self._sent_at.get(replica)
        sent = classes.get((band, tenant)) if classes is not None else None
        if not sent:
            return
        at, before = sent.popleft()
        if not sent:
            del classes[(band, tenant)]  # type: ignore[union-attr]
            if not classes:
                del self._sent_at[replica]
        now = self.clock()
        self._slot_samples.append((now, (now - at) / (before + 1)))

    def slot_time(self) -> float | None:
        """The engine's seconds to a first token per position in its queue (a request
        sent behind ``k`` others gets its first token after about ``(k + 1)`` times this):
        the ``SLOT_QUANTILE`` of the samples of the last ``RATE_WINDOW_S`` (None: too few
        to say)."""
        samples = self._slot_samples
        now = self.clock()
        while samples and samples[0][0] < now - RATE_WINDOW_S:
            samples.popleft()
        if len(samples) < MIN_RATE_SAMPLES:
            return None
        key = (len(samples), samples[0][0], samples[-1][0])
        if self._slot_cached is not None and self._slot_cached[0] == key:
            return self._slot_cached[1]
        xs = sorted(x for _, x in samples)
        per = xs[int(SLOT_QUANTILE * (len(xs) - 1))]
        self._slot_cached = (key, per)
        return per

    def engine_wait(self, replica: str, band: int) -> float | None:
        """Seconds from a send to ``replica`` now to its first token there (None: unknown)."""
        per = self.slot_time()
        return None if per is None else (self.unstarted_ahead(replica, band) + 1) * per

    def in_time(self, w: Waiter, replicas: list[str], now: float) -> list[str]:
        """Those of ``replicas`` where ``w``, sent now, would get its first token by its
        deadline (all of them: no deadline, or no estimate yet)."""
        per = self.slot_time()
        if w.deadline is None or per is None:
            return replicas
        slack = w.deadline - now
        return [r for r in replicas if (self.unstarted_ahead(r, w.band) + 1) * per <= slack]

    def estimated_wait(self, band: int) -> float | None:
        rate = self.drain_rate()
        if rate is None:
            return None
        return self.bands.ahead_of(band) / rate

    # -- submit, cancel --------------------------------------------------------------------
    def submit(self, w: Waiter) -> bool:
        """Sends ``w`` now (True; a failure of the send raised here) when nothing at its
        priority or more urgent waits and a replica it may go to has room (or none is left:
        the send says so); else queues it (False: await ``w.future``), or raises
        :class:`ShedError` when its band is full or its deadline cannot be met."""
        room = self.enter(w)
        if isinstance(room, Queued):
            return False
        w.dispatch(room)
        return True

    def enter(self, w: Waiter) -> list[str] | Queued | None:
        """:meth:`submit` without calling ``w.dispatch``: the replicas to send ``w`` among
        now (None: any), which the caller does at once, or :data:`QUEUED` (``dispatch`` is
        called when its turn comes). A run sends itself (request_run.py): the door never
        calls back into it on its way in."""
        now = self.clock()
        w.since = now
        if not self.bands.waiting or not self.bands.ahead_of(w.band):  # none before: sent if room
            eligible = w.eligible()
            room = [r for r in eligible if self.has_room(r, w.band, w.tenant)]
            if room:
                fits = self.in_time(w, room, now)
                if not fits:  # room, but a queue in every engine it could go to too long
                    self._shed(w.band, "deadline")
                    wait = min(self.engine_wait(r, w.band) or 1.0 for r in room)
                    raise ShedError(
                        f"The request's TTFT deadline cannot be met: about {wait:.1f} s of "
                        "requests are queued in the replicas it may go to; retry later.",
                        "deadline",
                        wait,
                    )
                self._dispatched(w, now)
                return fits
            if not eligible:
                self._dispatched(w, now)
                return None
        if w.deadline is not None and w.deadline <= now:
            self._shed(w.band, "deadline")
            raise ShedError("The request's TTFT deadline has passed.", "deadline", 1.0)
        if self.max_waiting is not None and self.bands.length(w.band) >= self.max_waiting:
            self._shed(w.band, "queue_full")
            rate = self.drain_rate()
            wait = self.bands.length(w.band) / rate if rate else 1.0
            raise ShedError(
                f"The queue for priority {w.band} is full ({self.max_waiting} waiting); "
                "retry later.",
                "queue_full",
                wait,
            )
        if w.deadline is not None:
            wait = self.estimated_wait(w.band)
            # then, sent behind what fills the emptiest replica it may go to
            per = self.slot_time()
            eligible = w.eligible()
            engine = (
                per * max(1, min(self.unstarted_ahead(r, w.band) for r in eligible))
                if per is not None and eligible
                else None
            )
            if (wait is not None or engine is not None) and now + (wait or 0.0) + (
                engine or 0.0
            ) > w.deadline:
                self._shed(w.band, "deadline")
                raise ShedError(
                    f"The request's TTFT deadline cannot be met: about {wait or 0.0:.1f} s "
                    "of requests wait ahead of it at the door, and "
                    f"{engine or 0.0:.1f} s in the replica it would go to; retry later.",
                    "deadline",
                    wait if wait is not None else 1.0,
                )
        self._enqueue(w)
        self.pump()  # it may have room where the heads ahead of it have none
        return QUEUED

    def _enqueue(self, w: Waiter) -> None:
        loop = asyncio.get_running_loop()
        w.future = loop.create_future()
        self.bands.push(w)
        if w.deadline is not None:
            delay = max(0.0, w.deadline - self.clock())
            w.timer = loop.call_later(delay, self._expire, w)
        if self._sweeper is None:
            self._sweeper = loop.call_later(SWEEP_S, self._sweep)

    def _remove(self, w: Waiter) -> None:
        """Takes ``w`` out of the queue (it is queued), and its deadline's timer."""
        self.bands.remove(w)
        if w.timer is not None:
            w.timer.cancel()
            w.timer = None

    def cancel(self, w: Waiter) -> None:
        """Its client left (or its run closed) while it waited: it leaves the queue.
        Idempotent; nothing if it was dispatched already."""
        if not w.queued:
            return
        self._remove(w)
        self.stats.cancelled += 1
        if w.future is not None and not w.future.done():
            w.future.cancel()

    def _expire(self, w: Waiter) -> None:
        """Its deadline passed while it waited: a 429 (it would be late whatever came)."""
        w.timer = None
        if w.queued:
            self._refuse_late(
                w, "The request's TTFT deadline passed while it waited for a replica."
            )

    def _refuse_late(self, w: Waiter, message: str) -> None:
        """A queued waiter out for its deadline: out of the queue, counted, told with a 429
        whose ``Retry-After`` is the drain of those ahead of its band."""
        self._remove(w)
        self._shed(w.band, "deadline")
        rate = self.drain_rate()
        wait = self.bands.ahead_of(w.band) / rate if rate else 1.0
        if w.future is not None and not w.future.done():
            w.future.set_exception(ShedError(message, "deadline", wait))

    def _shed(self, band: int, cause: str) -> None:
        key = (band, cause)
        self.stats.shed[key] = self.stats.shed.get(key, 0) + 1

    def _dispatched(self, w: Waiter, now: float) -> None:
        self.stats.dispatched[w.band] = self.stats.dispatched.get(w.band, 0) + 1
        self._dispatch_times.append(now)
        if self.bands.waiting:  # others wait: charged (nothing waiting, no counter is kept)
            self.bands.charge(w.tenant, w.cost)
        if self.on_wait is not None:
            self.on_wait(w.band, now - w.since)

    # -- dispatch ----------------------------------------------------------------------------
    def pump(self) -> None:
        """Sends waiters while some head has room (the order in the module's docstring).
        Re-entrant calls (a send that frees a slot) are folded into the running one."""
        if self._pumping:
            self._again = True
            return
        self._pumping = True
        try:
            while True:
                self._again = False
                while self._pump_one():
                    pass
                if not self._again:
                    break
        finally:
            self._pumping = False

    def _pump_one(self) -> bool:
        """Sends (or refuses as late) the first head in dispatch order with a replica it may
        go to with room, or none left; whether it did (the bands changed)."""
        for head in self.bands.heads():
            eligible = head.eligible()
            room = [r for r in eligible if self.has_room(r, head.band, head.tenant)]
            if room:
                fits = self.in_time(head, room, self.clock())
                if not fits:  # checked at dispatch: refused rather than sent late
                    self._late(head)
                    return True
                self._send(head, fits)
                return True
            if not eligible:
                self._send(head, None)
                return True
        return False

    def _late(self, w: Waiter) -> None:
        """``w``'s turn came, but no replica with room can give it its first token by its
        deadline: a 429, as if the deadline had passed."""
        self._refuse_late(
            w,
            "The request's TTFT deadline can no longer be met: the replicas with room for it "
            "have too long a queue.",
        )

    def _send(self, w: Waiter, room: list[str] | None) -> None:
        self._remove(w)
        self._dispatched(w, self.clock())
        fut = w.future
        try:
            w.dispatch(room)
        except Exception as exc:  # the send's failure is the waiter's, raised where it waits
            if fut is not None and not fut.done():
                fut.set_exception(exc)
            return
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _sweep(self) -> None:
        """The safety net: whatever changed unseen (a replica back, a cordon lifted)."""
        self._sweeper = None
        if not self.waiting:
            return
        self.pump()
        if self.waiting:
            self._sweeper = asyncio.get_running_loop().call_later(SWEEP_S, self._sweep)

    def wake(self, *_: object) -> None:
        """A replica joined or left: look again (a callback of the fleet's)."""
        if self.waiting:
            self.pump()

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
