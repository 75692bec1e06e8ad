"""``kvroute serve``'s engine and placement flags checked before Ray or any replica starts.

Why: a replica checks its engine configuration itself, but only once Ray is up and the
actor is being built, so a negative tier size came back as a Ray traceback tens of seconds
later, and a host tier larger than the machine was not noticed at all. What can be checked
from the flags and this machine is checked here, and refused in one line (exit status 2,
as argparse's errors); what depends on the model (a host tier smaller than one block, a
``--max-model-len`` past the model's) is still the replica's to say.

With ``--address`` the replicas run on the cluster's nodes, not here: what this machine's
memory or disk says is then a warning, not a refusal.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

_SIZE = re.compile(r"\s*(-?\d+(?:\.\d+)?)\s*([kmgtp]?)(i?)b?\s*", re.IGNORECASE)
# Names kvroute's engine looks up on torch (getattr(torch, dtype)); vLLM's own set.
KVROUTE_DTYPES = ("float32", "float", "float16", "half", "bfloat16", "float64", "double")
VLLM_DTYPES = ("auto", "float32", "float", "float16", "half", "bfloat16")


def byte_size(text: str) -> int:
    """A size in bytes: ``1000000``, ``64GiB``, ``1.5G``, ``512Mi`` (argparse's type for
    the KV tiers' sizes; the sign is checked later, in one line)."""
    m = _SIZE.fullmatch(text)
    if m is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size in bytes (e.g. 1000000000, 64GiB, 1.5G)"
        )
    number, unit, binary = m.groups()
    if binary and not unit:
        raise argparse.ArgumentTypeError(f"{text!r}: 'i' needs a unit (KiB, MiB, GiB, TiB)")
    scale = (1024 if binary else 1000) ** ("kmgtp".index(unit.lower()) + 1) if unit else 1
    return int(float(number) * scale) if "." in number else int(number) * scale


def gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"


def memory_bytes() -> int | None:
    """This machine's memory (or its cgroup's limit, when lower); None: unknown."""
    total = None
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            total = min(total or int(limit), int(limit))
    except OSError:
        pass
    return total


def folder_problem(path: str) -> str | None:
    """Why ``path`` cannot be a folder this process writes in (None: it can, or can be
    made): it exists and is not a folder, or is not writable, or its nearest existing
    parent is one of those."""
    p = Path(path).expanduser().absolute()
    if p.exists():
        if not p.is_dir():
            return f"{path} is not a folder"
        if not os.access(p, os.W_OK | os.X_OK):
            return f"{path} is not writable"
        return None
    parent = p.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{path} cannot be made: {parent} is not a folder"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{path} cannot be made: {parent} is not writable"
    return None


def local_gpus() -> int | None:
    """The GPUs a local Ray would find here (Ray's own count); None: unknown."""
    try:
        from ray._private.accelerators import get_accelerator_manager_for_resource

        return int(get_accelerator_manager_for_resource("GPU").get_current_node_num_accelerators())
    except Exception:
        return None


def check_serve(
    args: argparse.Namespace, simulated: bool, warn: Callable[[str], None]
) -> str | None:
    """The first thing wrong with ``kvroute serve``'s engine and placement flags, in one
    line (None: nothing); ``warn`` gets what may be wrong on a cluster's other nodes."""
    for flag, least in (
        ("num_blocks", 1),
        ("max_model_len", 2),  # a prompt token and one generated
        ("block_size", 1),
        ("long_prefill_token_threshold", 0),
        ("max_num_partial_prefills", 0),
        ("kv_host_bytes", 0),
        ("kv_disk_bytes", 0),
        ("num_cpus_per_replica", 0),
        ("num_gpus_per_replica", 0),
    ):
        value = getattr(args, flag, None)
        if value is not None and not value >= least:
            return f"--{flag.replace('_', '-')} must be >= {least}, not {value:g}"
    link = getattr(args, "kv_link_gbps", None)
    if link is not None and not link > 0:
        return f"--kv-link-gbps must be > 0, not {link:g}"
    if getattr(args, "prefix_fetch", False) and args.engine == "vllm":
        return "--prefix-fetch: kvroute's engine only (vLLM has no prefix fetch)"
    if getattr(args, "pd_split", "") == "pair" and (args.engine == "vllm" or simulated):
        return "--pd-split pair: kvroute's engine with a model only (every replica pulls KV)"
    if getattr(args, "prefix_fetch", False) and simulated:
        return "--prefix-fetch needs a model; sim: replicas are cost models"
    if getattr(args, "wait_for_resources", False) and args.max_replicas is None:
        return "--wait-for-resources applies to autoscaling (--max-replicas)"
    vllm = args.engine == "vllm"
    dtypes = VLLM_DTYPES if vllm else KVROUTE_DTYPES
    if args.dtype and args.dtype not in dtypes:
        return f"--dtype {args.dtype}: not one of {', '.join(dtypes)}"
    tiers = bool(args.kv_host_bytes or args.kv_disk_path or args.kv_disk_bytes)
    if tiers and vllm:
        return "--kv-host-bytes / --kv-disk-path are kvroute's engine's; vLLM has its own"
    if tiers and simulated:
        return "--kv-host-bytes / --kv-disk-path need a model; sim: replicas are cost models"
    if bool(args.kv_disk_path) != bool(args.kv_disk_bytes):
        return "--kv-disk-path and --kv-disk-bytes go together"
    remote = bool(args.address)
    # Every replica on this machine (a local Ray), as many as autoscaling may start.
    here = max(args.replicas or 2, getattr(args, "max_replicas", None) or 0)
    if args.kv_disk_path and (why := folder_problem(args.kv_disk_path)):
        if not remote:
            return f"--kv-disk-path: {why}"
        warn(f"--kv-disk-path: {why} on this machine; the replicas' nodes need it")
    if args.kv_host_bytes and (memory := memory_bytes()):
        want = args.kv_host_bytes * (1 if remote else here)
        if want > memory:
            each = f"{args.kv_host_bytes:,} bytes ({gib(args.kv_host_bytes)}) per replica"
            if not remote:
                return (
                    f"--kv-host-bytes: {each} x {here} replica(s) is {gib(want)}; this "
                    f"machine has {gib(memory)} of memory"
                )
            warn(f"--kv-host-bytes: {each} is more than this machine's {gib(memory)} of "
                 "memory; each replica's node must have it")  # fmt: skip
    if args.kv_disk_path and args.kv_disk_bytes and not remote:
        why = _disk_room(args.kv_disk_path, args.kv_disk_bytes * here)
        if why:
            return f"--kv-disk-bytes: {args.kv_disk_bytes:,} per replica x {here}: {why}"
    gpus = args.num_gpus_per_replica or 0
    if gpus and not remote and (found := local_gpus()) is not None and gpus * here > found:
        return (
            f"--num-gpus-per-replica {gpus:g} x {here} replica(s) needs {gpus * here:g} GPU(s); "
            f"this machine has {found} (a replica without one would wait for ever)"
        )
    return None


def _disk_room(path: str, want: int) -> str | None:
    """Why ``want`` bytes cannot fit on ``path``'s file system (None: they can)."""
    p = Path(path).expanduser().absolute()
    while not p.exists():
        p = p.parent
    try:
        size = shutil.disk_usage(p).total
    except OSError:
        return None
    return f"{gib(want)} is more than its file system's {gib(size)}" if want > size else None


def check_front_door(args: argparse.Namespace) -> str | None:
    """The first thing wrong with the front door's numeric flags (``kvroute serve`` and
    ``kvroute router``), in one line (None: nothing)."""
    port = getattr(args, "port", None)
    if port is not None and not 0 <= port <= 65535:
        return f"--port must be 0-65535, not {port}"
    backends = any(getattr(args, f, None) for f in ("backend", "prefill", "decode"))
    if getattr(args, "pd_split", "") == "pair" and backends:
        return "--pd-split pair: kvroute's replicas only (vllm serve backends pair by role)"
    for flag, least, strict in (
        ("max_in_flight", 1, False),
        ("max_in_flight_per_tenant", 1, False),
        ("admission_queue", 0, False),
        ("flow_depth", 0, False),
        ("flow_tokens", 1, False),
        ("max_waiting_per_priority", 1, False),
        ("max_body_bytes", 1, False),
        ("admission_timeout", 0, False),
        ("body_timeout", 0, True),
        ("send_timeout", 0, True),
    ):
        value = getattr(args, flag, None)
        if value is None:
            continue
        if (value <= least) if strict else (value < least):
            return f"--{flag.replace('_', '-')} must be {'>' if strict else '>='} {least}"
    if getattr(args, "enable_auto_tool_choice", False) and not getattr(
        args, "tool_call_parser", None
    ):
        return "--enable-auto-tool-choice needs --tool-call-parser (how the model writes calls)"
    return None
