"""The autoscaler's decision (deploy/autoscale.py), with a clock and numbers: the size Ray
Serve's rule asks for (ongoing requests over the target, within the bounds), averaged over
the look-back window, and made only once the wish held for its delay."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from kvroute.deploy.autoscale import AutoscaleConfig, Autoscaler

from ..ray_session import shutdown
from ..serve_process import kvroute_serve
from ..waiting import poll, wait_for
from .streaming import Stream, metric, read_stream

CONFIG = AutoscaleConfig(1, 4, 8.0, upscale_delay_s=10.0, downscale_delay_s=60.0)


def replicas(url: str) -> list[str]:
    return sorted(httpx.get(url + "/health", timeout=10).json()["replicas"])


def feed(scaler: Autoscaler, replicas: int, ongoing: float, start: float, end: float, room=None):
    """Samples every 2 s from ``start`` to ``end``; the first decision made (time, size).
    ``room``: the largest fleet the cluster holds (``Autoscaler.decide``'s)."""
    t = start
    while t <= end:
        got = (
            scaler.decide(t, replicas, ongoing, room)
            if room
            else scaler.decide(t, replicas, ongoing)
        )
        if got is not None:
            return t, got
        t += 2.0
    return None


def test_the_size_is_ongoing_over_the_target_within_the_bounds() -> None:
    s = Autoscaler(CONFIG)
    assert [s.desired(x) for x in (0, 1, 8, 8.5, 16, 17, 100)] == [1, 1, 1, 2, 2, 3, 4]


def test_more_replicas_once_the_load_held_for_the_upscale_delay() -> None:
    s = Autoscaler(CONFIG)
    assert feed(s, 1, 4.0, 0, 100) is None  # within one replica's target: no change
    t, n = feed(s, 1, 20.0, 102, 200)  # type: ignore[misc]
    # The mean over the window must first rise past 8 (a burst is not a trend), then the
    # wish must hold 10 s.
    assert n >= 2 and 112 <= t <= 140, (t, n)


def test_a_burst_shorter_than_the_delay_changes_nothing() -> None:
    s = Autoscaler(CONFIG)
    feed(s, 1, 4.0, 0, 60)
    assert feed(s, 1, 12.0, 62, 68) is None  # over one replica's target, for 8 s
    assert feed(s, 1, 0.0, 70, 200) is None  # and gone


def test_fewer_replicas_only_after_the_downscale_delay_and_never_below_the_minimum() -> None:
    s = Autoscaler(CONFIG)
    t, n = feed(s, 4, 0.0, 0, 500)  # type: ignore[misc]
    assert (n, t) == (1, 60.0)  # the minimum, after 60 s of asking for it
    assert feed(s, 1, 0.0, 62, 500) is None


def test_a_wish_that_turns_around_starts_its_delay_again() -> None:
    s = Autoscaler(CONFIG, look_back_s=0.0)  # no averaging: each sample is the load
    assert feed(s, 2, 0.0, 0, 40) is None  # 40 s of "down" (needs 60)
    assert feed(s, 2, 12.0, 42, 44) is None  # back at two replicas' worth: the wish resets
    assert feed(s, 2, 0.0, 46, 100) is None  # "down" again from 46: not before 106
    assert feed(s, 2, 0.0, 102, 110) == (106.0, 1)


def test_a_grow_is_cut_to_what_the_cluster_holds() -> None:
    """The load asks for 4 replicas; the cluster holds 2: the grow goes to 2, not to 4
    replicas of which 2 would wait for resources. At the limit the wish stands but no
    decision comes; once room appears (a node joined), the grow goes on."""
    s = Autoscaler(CONFIG, look_back_s=0.0)
    holds = {"most": 2}
    asked: list[tuple[float, int]] = []

    def room(replicas: int) -> int:
        asked.append((replicas, holds["most"]))
        return holds["most"]

    assert feed(s, 1, 40.0, 0, 100, room) == (10.0, 2)
    assert s.limited == 4  # what the load asked for, for the log line
    assert asked == [(1, 2)]  # asked once, only when the grow was due
    assert feed(s, 2, 40.0, 12, 60, room) is None  # nothing fits: no decision ...
    assert s.limited == 4 and len(asked) > 1  # ... asked again each sample, cut each time
    holds["most"] = 3
    assert feed(s, 2, 40.0, 62, 100, room) == (62.0, 3)
    assert feed(s, 3, 0.0, 102, 300, room) == (162.0, 1)  # a shrink never asks
    assert asked[-1] == (2, 3) and s.limited is None


@pytest.mark.parametrize(
    ("config", "why"),
    [
        (AutoscaleConfig(0, 2, 8.0), "--min-replicas"),
        (AutoscaleConfig(3, 2, 8.0), "--max-replicas"),
        (AutoscaleConfig(1, 2, 0.0), "--target-ongoing-requests"),
        (AutoscaleConfig(1, 2, 8.0, -1.0), "--upscale-delay"),
    ],
)
def test_bad_settings_are_named(config: AutoscaleConfig, why: str) -> None:
    assert why in (config.check() or "")


class Load:
    """``n`` streams at all times (a new one as each ends) until stopped: the load a busy
    fleet sees, however fast its replicas are."""

    def __init__(self, url: str, n: int, max_tokens: int) -> None:
        self.url, self.max_tokens = url, max_tokens
        self.streams: list[Stream] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._keep, args=(i,)) for i in range(n)]
        for t in self.threads:
            t.start()

    def _keep(self, slot: int) -> None:
        k = 0
        while not self.stop.is_set():
            s = Stream(
                f"Slot {slot} stream {k}: " + " ".join(f"w{slot}x{k}y{j}" for j in range(20))
            )
            s.t0 = time.monotonic()
            self.streams.append(s)
            read_stream(self.url, s, self.max_tokens)
            k += 1

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(300)


@pytest.mark.slow
def test_a_live_fleet_grows_under_load_and_shrinks_when_idle() -> None:
    """``kvroute serve --max-replicas 2`` (short delays, a target of 2 requests): six
    streams kept running on one replica bring up a second, to which new streams then go;
    once the load is gone the second is drained and stopped. No stream fails or moves."""
    shutdown()  # kvroute serve starts a Ray of its own: none of this process's may linger
    log: list[str] = []
    args = ["--model", "tiny", "--replicas", "1", "--max-replicas", "2",
            "--target-ongoing-requests", "2", "--upscale-delay", "2", "--downscale-delay", "4",
            "--fleet-secret", "autoscale-test", "--policy", "least_loaded"]  # fmt: skip
    # least_loaded: where new streams go is then the fleet's doing, not a price (kv prices
    # each replica in its own measured seconds, and a replica that measured itself on 2
    # cores shared with six streams looks slow).
    with kvroute_serve(args, log=log) as url:
        load = Load(url, 6, 400)
        t0 = time.monotonic()
        try:
            wait_for(lambda: replicas(url) == ["r0", "r1"], 120, "a second replica")
            joined = time.monotonic()
            assert any("autoscaling 1 -> 2" in line for line in log), "".join(log)
            got = poll(lambda: any(s.replica == "r1" and s.t0 > joined for s in load.streams), 60)
            assert got, (
                "no new stream on r1 within 60 s: "
                + str([(s.replica, round(s.t0 - joined, 1)) for s in load.streams[-12:]])
                + "\n"
                + "".join(log[-30:])
            )
        finally:
            load.close()
        idle = time.monotonic()
        for s in load.streams:
            assert (s.error, s.tokens, s.finish) == (None, 400, "length"), s.replica
        wait_for(lambda: replicas(url) == ["r0"], 180, "back to one replica when idle")
        on_r1 = sum(s.replica == "r1" for s in load.streams)
        print(f"\nautoscale: r1 listed {joined - t0:.1f} s after the load began; "
              f"{on_r1} of {len(load.streams)} streams on r1; back to one replica "
              f"{time.monotonic() - idle:.1f} s after the load ended")  # fmt: skip
        assert any("autoscaling 2 -> 1" in line for line in log), "".join(log)
        with httpx.Client(base_url=url, timeout=10) as c:
            assert metric(c, "kvroute:failovers_total") == 0
            assert metric(c, "kvroute:errors_total", kind="replica_failure") == 0
