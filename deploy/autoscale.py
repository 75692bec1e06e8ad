"""Autoscaling for ``kvroute serve --max-replicas N``: the fleet's size follows its load.

The rule is Ray Serve's, which the people running kvroute know (its default target is
not: an engine batches, so 32 here, not 2): each replica should hold about
``--target-ongoing-requests`` requests (running or waiting in its engine), so the
fleet wants ``ceil(ongoing / target)`` replicas, within ``--min-replicas`` and
``--max-replicas``. The ongoing count is averaged over the last ``LOOK_BACK_S`` (one burst
is not a trend), and a change is made only after the wish has pointed the same way for
``--upscale-delay`` (default 30 s) or ``--downscale-delay`` (600 s): a replica costs a
model load to add, and one removed too soon is paid for again at the next burst. The change
itself is ``kvroute scale``'s (:func:`kvroute.deploy.scale.resize`): new replicas are twins
of the running ones, retired ones are drained first, so a decision cuts no request short.
A wish for more replicas than the cluster holds (:mod:`.capacity`: its free resources, or
its autoscaler's limit) is cut to what it holds, and said once: a replica that waits for
resources serves nothing, and would be drained for nothing at the next shrink
(``--wait-for-resources``: grow anyway, for nodes that are coming).

:class:`Autoscaler` is the decision alone (no Ray: tested with a clock and numbers);
:func:`run_autoscaler` polls the replicas' load reports and applies it, on a thread of
``kvroute serve``'s process (the only one that scales: extra front doors do not).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

LOOK_BACK_S = 30.0  # ongoing requests are averaged over this long (Ray Serve's default)
POLL_S = 2.0  # the replicas' loads are read this often


@dataclass(frozen=True, slots=True)
class AutoscaleConfig:
    min_replicas: int
    max_replicas: int
    target_ongoing_requests: float
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0

    def check(self) -> str | None:
        """What is wrong with it (None: nothing)."""
        if self.min_replicas < 1:
            return "--min-replicas must be >= 1"
        if self.max_replicas < self.min_replicas:
            return "--max-replicas must be >= --min-replicas"
        if self.target_ongoing_requests <= 0:
            return "--target-ongoing-requests must be > 0"
        if self.upscale_delay_s < 0 or self.downscale_delay_s < 0:
            return "--upscale-delay and --downscale-delay must be >= 0"
        return None


class Autoscaler:
    """The fleet size to move to, given samples of its ongoing requests over time."""

    def __init__(self, config: AutoscaleConfig, look_back_s: float = LOOK_BACK_S) -> None:
        self.config = config
        self.look_back_s = look_back_s
        self._samples: deque[tuple[float, float]] = deque()
        self._since: float | None = None  # when the wish first pointed the current way
        self._direction = 0  # +1 up, -1 down, 0 none
        self.limited: int | None = None  # the last grow's wish, where the cluster cut it

    def desired(self, ongoing: float) -> int:
        c = self.config
        want = math.ceil(ongoing / c.target_ongoing_requests - 1e-9)
        return min(max(want, c.min_replicas), c.max_replicas)

    def decide(
        self,
        now: float,
        replicas: int,
        ongoing: float,
        room: Callable[[int], int | None] | None = None,
    ) -> int | None:
        """A new size once the wish held for its delay (None: stay). ``replicas``: the
        fleet's size now; ``ongoing``: its requests running or waiting, now; ``room``: the
        largest fleet the cluster holds, given this one's size (None: no limit), asked only
        before a grow. A grow is cut to it (``limited``: the wish so cut, else None); one
        with no room at all is no decision, and the wish stands."""
        self.limited = None
        self._samples.append((now, ongoing))
        while self._samples and self._samples[0][0] < now - self.look_back_s:
            self._samples.popleft()
        mean = sum(v for _, v in self._samples) / len(self._samples)
        want = self.desired(mean)
        direction = (want > replicas) - (want < replicas)
        if direction != self._direction:
            self._direction, self._since = direction, now
        if direction == 0 or self._since is None:
            return None
        delay = self.config.upscale_delay_s if direction > 0 else self.config.downscale_delay_s
        if now - self._since < delay:
            return None
        if direction > 0 and room is not None:
            most = room(replicas)
            if most is not None and want > most:
                self.limited = want
                want = max(most, replicas)
                if want == replicas:  # nothing fits: asked again at the next sample
                    return None
        self.reset()
        return want

    def reset(self) -> None:
        """Forget the history (after a resize: the new fleet's load is what counts)."""
        self._samples.clear()
        self._direction, self._since = 0, None


def run_autoscaler(
    config: AutoscaleConfig,
    say: Callable[[str], None],
    stop: threading.Event,
    ready_timeout: float = 900.0,
    drain_timeout: float = 300.0,
    wait_for_resources: bool = False,
    queued: Callable[[], int] | None = None,
) -> None:
    """Until ``stop``: reads every replica's load (Ray, this driver's namespace) every
    ``POLL_S`` and resizes the fleet as :class:`Autoscaler` decides, within what the
    cluster holds (unless ``wait_for_resources``). ``stop`` also ends a grow under way
    (its replicas not ready yet are stopped). ``queued``: the requests waiting at this
    process's front door (flow control), counted as ongoing: they are load the replicas
    do not report."""
    from .router import answers, named_replicas
    from .scale import resize

    scaler = Autoscaler(config)
    failures = 0
    room = _Room()
    said: tuple[int, int] | None = None  # the last cut said: (wished, held)
    while not stop.wait(POLL_S):
        try:
            fleet = named_replicas()
            # What answers in time counts; a replica loading or restarting adds nothing.
            loads = answers({rid: a.load.remote() for rid, a in fleet.items()}, 5).values()
            ongoing = sum(r.num_running + r.num_waiting for r in loads if r is not None)
            ongoing += queued() if queued is not None else 0
            failures = 0
        except Exception as exc:  # Ray's listing failed: the next poll decides
            failures += 1
            if failures == 10:  # said once, not every poll
                say(f"autoscaling cannot read the fleet ({type(exc).__name__}: {exc})")
            continue
        room.fleet = fleet
        want = scaler.decide(
            time.monotonic(), len(fleet), ongoing, None if wait_for_resources else room
        )
        if scaler.limited is not None:
            held = len(fleet) if want is None else want
            if said != (scaler.limited, held):  # once per cut, not every poll
                said = (scaler.limited, held)
                say(f"autoscaling: the load asks for {scaler.limited} replicas; the cluster "
                    f"holds {held} ({room.describe()}): {held} it is (kvroute serve "
                    "--wait-for-resources grows anyway, for nodes that are coming)")  # fmt: skip
        elif want is not None:
            said = None
        if want is None:
            continue
        say(f"autoscaling {len(fleet)} -> {want} replicas ({ongoing} requests ongoing, "
            f"target {config.target_ongoing_requests:g} per replica)")  # fmt: skip
        try:
            resize(
                want,
                ready_timeout,
                drain_timeout,
                say,
                wait_for_resources=wait_for_resources,
                stop=stop,
            )
        except Exception as exc:  # a failed resize is said; the loop goes on
            say(f"autoscaling failed: {type(exc).__name__}: {exc}")
        scaler.reset()


class _Room:
    """The largest fleet the cluster holds (:mod:`.capacity`), for :meth:`Autoscaler.decide`:
    what one replica needs is read once, from a running replica's launch spec."""

    def __init__(self) -> None:
        self.fleet: dict[str, Any] = {}
        self.need: dict[str, float] | None = None

    def __call__(self, replicas: int) -> int | None:
        from .capacity import room_for

        if self.need is None:
            self.need = self._read_need()
        return None if self.need is None else room_for(self.need).grows_to(replicas)

    def _read_need(self) -> dict[str, float] | None:
        from .capacity import need_of, not_running
        from .router import answers

        pending = not_running(self.fleet)
        asked = {rid: a for rid, a in self.fleet.items() if rid not in pending}
        specs = answers({rid: a.launch_spec.remote() for rid, a in asked.items()}, 10)
        spec = next((s for s in specs.values() if s is not None), None)
        return None if spec is None else need_of(spec.options)

    def describe(self) -> str:
        need = ", ".join(f"{k} {v:g}" for k, v in (self.need or {}).items())
        return f"each needs {need}" if need else "its resources"
