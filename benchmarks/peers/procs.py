"""Ports, HTTP, ``/proc`` and the servers ``peers_vllm.py`` starts and tears down.

Split out of ``benchmarks/peers_vllm.py``: free ports never handed out twice, small HTTP
and Prometheus helpers, a process tree's members, and :class:`Server` (one process group,
started, waited for, stopped) with :class:`Stack`, which stops every server it started.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proc_cpu import tree_cpu_seconds

from .setup import VLLM_CLI, StartError, say

# --- ports, HTTP, /proc -----------------------------------------------------------------

_handed_out: set[int] = set()


def free_port() -> int:
    """A port nothing listens on now, never handed out twice by this script."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def http(method: str, url: str, body: Any = None, timeout: float = 10.0) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")


def answers(url: str) -> bool:
    try:
        return http("GET", url, timeout=5)[0] == 200
    except (OSError, urllib.error.URLError):
        return False


def scrape(url: str) -> list[tuple[str, str, float]]:
    """(name, labels, value) of every sample on a Prometheus text page."""
    out = []
    for line in http("GET", url, timeout=10)[1].splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([^{\s]+)(\{.*\})?\s+(\S+)", line)
        if m:
            with contextlib.suppress(ValueError):
                out.append((m.group(1), m.group(2) or "", float(m.group(3))))
    return out


def metric_sum(samples: list[tuple[str, str, float]], *names: str) -> float:
    return sum(v for n, _, v in samples if n in names)


CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()  # fields from the 3rd (state) on


def descendants(root: int) -> list[tuple[int, str]]:
    """(pid, start time) of ``root`` and every live process below it."""
    children: dict[int, list[int]] = {}
    start: dict[int, str] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = _stat(int(d))
            if st:
                children.setdefault(int(st[1]), []).append(int(d))
                start[int(d)] = st[19]
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in start:
            out.append((pid, start[pid]))
        todo.extend(children.get(pid, []))
    return out


# --- processes --------------------------------------------------------------------------


@dataclass
class Server:
    name: str
    cmd: list[str]
    env: dict[str, str]
    log: Path
    url: str
    proc: subprocess.Popen[bytes] | None = None
    tree: list[tuple[int, str]] = field(default_factory=list)

    def start(self) -> Server:
        say(f"starting {self.name}: {shell_line(self.cmd)}")
        with open(self.log, "wb") as out:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                self.cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                start_new_session=True, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        return self

    def tail(self, n: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-n:]
        return ""

    def wait_ready(self, ready: Callable[[], bool], timeout: float) -> None:
        assert self.proc is not None
        t0 = time.monotonic()
        while not ready():
            if self.proc.poll() is not None:
                raise StartError(
                    f"{self.name} exited with status {self.proc.returncode} before it was "
                    f"ready; the end of its log ({self.log}):\n{self.tail()}"
                )
            if time.monotonic() - t0 > timeout:
                raise StartError(
                    f"{self.name} not ready after {timeout:.0f} s; the end of its log "
                    f"({self.log}):\n{self.tail()}"
                )
            time.sleep(1.0)
        self.tree = descendants(self.proc.pid)
        say(f"{self.name} ready in {time.monotonic() - t0:.0f} s at {self.url}")

    def cpu_seconds(self) -> float:
        assert self.proc is not None
        return tree_cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        """SIGINT to its process group, then SIGKILL; then any process of its tree (as seen
        when it was ready, or now) that outlived the group, by pid and start time."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.tree = list({*self.tree, *descendants(self.proc.pid)})
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)
        for pid, started in self.tree:
            st = _stat(pid)
            if st and st[19] == started and pid != os.getpid():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self.proc = None


class Stack(contextlib.ExitStack):
    def server(self, s: Server) -> Server:
        self.callback(s.stop)
        return s.start()


def shell_line(cmd: list[str]) -> str:
    """The command as one could paste it (kvroute's vLLM CLI module shown as ``vllm``)."""
    import shlex

    parts = []
    i = 0
    while i < len(cmd):
        if tuple(cmd[i : i + 2]) == VLLM_CLI:
            parts[-1:] = ["vllm"]
            i += 2
            continue
        parts.append(shlex.quote(cmd[i]))
        i += 1
    return " ".join(parts)
