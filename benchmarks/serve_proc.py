"""Start and stop a ``kvroute serve`` for a benchmark: one place for the wait on its
``ready:`` line and the Ctrl-C-then-kill stop (imported with this folder first on
``sys.path``, as ``proc_cpu``)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


def start_serve(
    cmd: list[str], log: Path, timeout_s: float, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Runs ``cmd`` with its output in ``log`` and waits for its ``ready: model`` line;
    ``env``: variables added to this process's (the replicas inherit them)."""
    full_env = {**os.environ, **env} if env else None
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=full_env)
    deadline = time.monotonic() + timeout_s
    while "ready: model" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"kvroute serve did not start; see {log}")
        time.sleep(1)
    return proc


def stop_serve(proc: subprocess.Popen[bytes], wait_s: float) -> None:
    """Ctrl-C (the fleet stops its replicas), then a kill if it takes longer than ``wait_s``."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
