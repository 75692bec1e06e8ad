"""One local Ray for the whole test run: starting one costs seconds, and a dozen modules
serve replicas on it. Each module kills the actors it started when it ends; if any are
still alive after that, Ray is shut down, and the next module starts a fresh one, so no
module sees another's actors."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import ray
from ray._private.state import actors as actor_table  # the GCS's table; no dashboard needed


def _alive() -> set[str]:
    return {aid for aid, a in actor_table().items() if a["State"] != "DEAD"}


@contextlib.contextmanager
def local_ray() -> Iterator[list[Any]]:
    """Yields a list: put the handles of the actors you start in it; they are killed at
    the end (and Ray restarted for the next user if that leaves anything alive)."""
    if not ray.is_initialized():
        # Replicas' own output stays in Ray's log files: tests kill replicas on purpose,
        # and Ray would relay their expected tracebacks into the test run's output.
        # "local": a Ray of this test process's own, never another one on the machine.
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            logging_level="warning",
            log_to_driver=False,
        )
    before = _alive()
    started: list[Any] = []
    try:
        yield started
    finally:
        for actor in started:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        deadline = time.monotonic() + 10
        while _alive() - before and time.monotonic() < deadline:
            time.sleep(0.1)
        if _alive() - before:
            ray.shutdown()


def shutdown() -> None:
    """Ends the shared Ray (before a module that needs a Ray of its own, and at the end)."""
    if ray.is_initialized():
        ray.shutdown()
