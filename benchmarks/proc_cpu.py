"""CPU time of process trees from /proc, for the benchmarks that measure it (Linux only).

A benchmark script imports it as a sibling module (``python benchmarks/X.py`` puts this
folder first on ``sys.path``).
"""

from __future__ import annotations

import os
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (None: the process is gone).
    Index 1 is the parent's pid, 11 and 12 utime and stime in ticks, 19 the start time."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def cpu_of(pids: set[int]) -> dict[int, float]:
    """utime + stime (s) of each pid still alive (all its threads)."""
    out = {}
    for pid in pids:
        f = stat(pid)
        if f is not None:
            out[pid] = (int(f[11]) + int(f[12])) / TICK
    return out


def wakeups_of(pids: set[int]) -> int:
    """Voluntary context switches of every thread of ``pids``: how often they slept and
    were woken. On a small VM a wake-up costs tens of us, so wake-ups per token explain
    CPU per token with much less noise than the CPU figure itself."""
    n = 0
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except FileNotFoundError:
            continue
        for tid in tids:
            try:
                text = Path(f"/proc/{pid}/task/{tid}/status").read_text()
            except (FileNotFoundError, ProcessLookupError):
                continue
            for line in text.splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    n += int(line.split()[1])
    return n


def tree(root: int, exclude: frozenset[int] | set[int] = frozenset()) -> set[int]:
    """``root`` and its descendants, less ``exclude`` and their descendants."""
    children: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            f = stat(int(p.name))
            if f is not None:
                children.setdefault(int(f[1]), []).append(int(p.name))
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid in exclude or pid in out:
            continue
        out.add(pid)
        todo.extend(children.get(pid, ()))
    return out


def tree_cpu_seconds(root: int) -> float:
    """utime + stime of ``root``'s live tree, plus what the children it waited for used
    (cutime + cstime): a fleet's CPU, replicas and helpers included."""
    ticks = 0
    for pid in tree(root):
        f = stat(pid)
        if f is not None:
            ticks += sum(int(x) for x in f[11:15])
    return ticks / TICK
