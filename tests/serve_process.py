"""``kvroute serve`` as users run it: its own process, on a free loopback port."""

from __future__ import annotations

import contextlib
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

KVROUTE = [sys.executable, "-m", "kvroute.deploy.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def kvroute_serve(
    args: Sequence[str],
    port: int | None = None,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    log: list[str] | None = None,
) -> Iterator[str]:
    """``kvroute serve ARGS --port PORT`` (default 0: a free one) until the block ends
    (then Ctrl-C, as a user stops it); yields its base URL once it printed ``ready:``.
    ``env`` and ``cwd``: the process's environment and directory (default: this one's);
    ``log``: gets every line it prints, as it prints them."""
    lines: list[str] = log if log is not None else []
    # Port 0 by default: the server binds a free one before Ray starts and names it in its
    # ready line (a port picked here could be taken by one of Ray's processes meanwhile).
    cmd = [*KVROUTE, "serve", *args, "--port", str(port or 0)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)
    assert proc.stderr is not None
    try:
        for line in proc.stderr:
            lines.append(line)
            if "ready:" in line:
                bound = re.search(r"http://\S+?:(\d+)/v1", line)
                assert bound, line
                port = int(bound.group(1))
                break
        else:
            raise AssertionError(f"kvroute serve exited {proc.wait()}:\n{''.join(lines)}")
        # Its log must be read on, or a full pipe would stall the server.
        stderr = proc.stderr
        threading.Thread(target=lambda: lines.extend(stderr), daemon=True).start()
        yield f"http://127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
