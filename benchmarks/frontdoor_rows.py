"""The rows, table and plot ``frontdoor_capacity.py`` prints from its runs.

Split out of ``benchmarks/frontdoor_capacity.py`` (the harness: servers, load, CPU
snapshots) so what it reports reads in one place: one row per server and scenario from its
runs (:func:`derive`), the markdown table (:func:`table`), the CPU-per-token plot
(:func:`plot`), JSON without NaN (:func:`finite`), and its progress lines (:func:`say`).
``api_server_cpu.py`` takes :func:`derive` through ``frontdoor_capacity``, as before.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

import numpy as np
from frontdoor_floor import MODEL

__all__ = ["derive", "finite", "fmt", "pct", "plot", "say", "table"]


def say(msg: str) -> None:
    print(f"frontdoor_capacity: {msg}", file=sys.stderr, flush=True)


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else math.nan


def derive(raws: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from one or more runs of the same server and scenario (summed CPU, tokens,
    requests and walls; pooled per-request latencies)."""
    first = raws[0]
    tot = {
        k: sum(r[k] for r in raws)
        for k in (
            "requests",
            "ok",
            "output_tokens",
            "load_wall_s",
            "window_wall_s",
            "frontdoor_cpu_s",
            "replica_cpu_s",
            "loadgen_cpu_s",
        )
    }
    errors: dict[str, int] = {}
    for r in raws:
        for k, v in r["errors"].items():
            errors[k] = errors.get(k, 0) + v
    fd_idle = sum(r["frontdoor_idle_per_s"] * r["window_wall_s"] for r in raws)
    rep_idle = sum(r["replica_idle_per_s"] * r["window_wall_s"] for r in raws)
    # CPU while the load ran: the idle share of the time around it (the load generator's
    # start and exit) taken out, the idle share during it kept -- a front door pays it.
    fd_busy = tot["frontdoor_cpu_s"] - sum(
        r["frontdoor_idle_per_s"] * max(r["window_wall_s"] - r["load_wall_s"], 0.0) for r in raws
    )
    fd_net, rep_net = tot["frontdoor_cpu_s"] - fd_idle, tot["replica_cpu_s"] - rep_idle
    tokens, ok, wall = tot["output_tokens"], tot["ok"], tot["load_wall_s"]
    idle_per_s = first["frontdoor_idle_per_s"]
    per_token = fd_net / tokens if tokens else math.nan
    outside = [x for r in raws for x in r["outside_s"]]
    ttft = [x for r in raws for x in r["ttft_s"]]

    def div(a: float, b: float, scale: float = 1.0) -> float:
        return scale * a / b if b else math.nan

    return {
        "server": first["server"],
        "scenario": first["scenario"],
        "concurrency": first["concurrency"],
        "rate": first["rate"],
        "prompt_tokens": first["prompt_tokens"],
        "max_tokens": first["max_tokens"],
        "runs": len(raws),
        **tot,
        "errors": errors,
        "frontdoor_idle_cpu_s": fd_idle,
        "replica_idle_cpu_s": rep_idle,
        "frontdoor_idle_cpu_per_s": idle_per_s,
        "request_rate": div(ok, wall),
        "tokens_per_s": div(tokens, wall),
        "frontdoor_us_per_token": div(fd_net, tokens, 1e6),
        "replica_us_per_token": div(rep_net, tokens, 1e6),
        "frontdoor_ms_per_request": div(fd_net, ok, 1e3),
        "replica_ms_per_request": div(rep_net, ok, 1e3),
        "frontdoor_util_cores": div(fd_busy, wall),
        # what one core sustains: tokens per front-door CPU second, idle share included ...
        "tokens_per_s_per_core": div(tokens, fd_busy) if fd_busy > 0 else math.nan,
        # ... and with the idle share counted once, not scaled with the load
        "tokens_per_s_at_1_core": (1.0 - idle_per_s) / per_token if per_token > 0 else math.nan,
        "added_ttft_p50_ms": 1e3 * pct(outside, 50),
        "added_ttft_p99_ms": 1e3 * pct(outside, 99),
        "ttft_p50_ms": 1e3 * pct(ttft, 50),
        "ttft_p99_ms": 1e3 * pct(ttft, 99),
    }


def fmt(x: Any, spec: str) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return format(x, spec)


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    by = {(r["server"], r["scenario"]): r for r in rows}
    lines = ["| figure | kvroute | floor | kvroute / floor |", "| --- | --- | --- | --- |"]

    def line(label: str, kv: Any, fl: Any, spec: str, ratio: bool = True) -> None:
        q = (
            kv / fl
            if ratio and isinstance(kv, float | int) and isinstance(fl, float | int) and fl
            else None
        )
        lines.append(f"| {label} | {fmt(kv, spec)} | {fmt(fl, spec)} | {fmt(q, '.2f')} |")

    def add(label: str, scenario: str, key: str, spec: str) -> None:
        k, f = by.get(("kvroute", scenario)), by.get(("floor", scenario))
        line(label, k and k[key], f and f[key], spec)

    concs = [int(c) for c in args.concurrency.split(",")]
    for c in concs:
        add(
            f"front door CPU us / streamed token ({c} x {args.stream_tokens}-token streams)",
            f"stream_c{c}",
            "frontdoor_us_per_token",
            ".1f",
        )
    for c in concs:
        add(
            f"replicas CPU us / streamed token ({c} streams)",
            f"stream_c{c}",
            "replica_us_per_token",
            ".1f",
        )
    req = f"{args.prompt_tokens} in, {args.short_tokens} out, {args.request_concurrency} concurrent"
    add(f"front door CPU ms / request ({req})", "per_request", "frontdoor_ms_per_request", ".2f")
    add(f"replicas CPU ms / request ({req})", "per_request", "replica_ms_per_request", ".2f")
    add("requests/s achieved (same runs)", "per_request", "request_rate", ".0f")
    r = f"{args.rate:g} req/s, {args.short_tokens} out"
    add(f"added TTFT p50 ms ({r})", "ttft", "added_ttft_p50_ms", ".2f")
    add(f"added TTFT p99 ms ({r})", "ttft", "added_ttft_p99_ms", ".2f")
    add(f"front door CPU ms / request ({r})", "ttft", "frontdoor_ms_per_request", ".2f")
    for c in concs:
        add(f"streamed tokens/s achieved ({c} streams)", f"stream_c{c}", "tokens_per_s", ".0f")
    for c in concs:
        add(
            f"front door CPU utilisation, cores ({c} streams)",
            f"stream_c{c}",
            "frontdoor_util_cores",
            ".3f",
        )
    for c in concs:
        add(
            f"tokens/s per front-door core = tokens / CPU s ({c} streams)",
            f"stream_c{c}",
            "tokens_per_s_per_core",
            ".0f",
        )
    top = f"stream_c{concs[-1]}"
    add(
        f"tokens/s at 1 front-door core, idle share counted once ({concs[-1]} streams)",
        top,
        "tokens_per_s_at_1_core",
        ".0f",
    )
    best = {}
    for server in ("kvroute", "floor"):
        sw = [x for x in rows if x["server"] == server and x["scenario"].startswith("stream_")]
        if sw:
            b = max(sw, key=lambda x: x["tokens_per_s"])
            best[server] = (
                f"{b['tokens_per_s']:.0f} ({b['concurrency']} streams, "
                f"{b['frontdoor_util_cores']:.2f} cores)"
            )
    line("highest streamed tokens/s achieved", best.get("kvroute"), best.get("floor"), "s", False)

    def total(server: str, key: str) -> Any:
        return sum(x[key] for x in rows if x["server"] == server)

    def errs(server: str) -> int:
        return sum(sum(x["errors"].values()) for x in rows if x["server"] == server)

    line("errors, all runs", errs("kvroute"), errs("floor"), "d", False)
    line(
        "output tokens counted, all runs",
        total("kvroute", "output_tokens"),
        total("floor", "output_tokens"),
        "d",
        False,
    )
    line(
        "load generator CPU s, all runs",
        total("kvroute", "loadgen_cpu_s"),
        total("floor", "loadgen_cpu_s"),
        ".1f",
        False,
    )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for server, color in (("kvroute", "tab:blue"), ("floor", "tab:orange")):
        sw = sorted(
            (
                r
                for r in rows
                if r["server"] == server
                and r["concurrency"]
                and r["scenario"].startswith("stream_")
            ),
            key=lambda r: r["concurrency"],
        )
        xs = [r["concurrency"] for r in sw]
        ax.plot(
            xs,
            [r["frontdoor_us_per_token"] for r in sw],
            "o-",
            color=color,
            label=f"{server}: front door",
        )
        ax.plot(
            xs,
            [r["replica_us_per_token"] for r in sw],
            "s--",
            color=color,
            alpha=0.6,
            label=f"{server} runs: replicas",
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("CPU us per streamed token (idle subtracted)")
    ax.set_title(f"Serving-path CPU per streamed token: {MODEL}, 2 replicas")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    say(f"plot: {path}")


def finite(obj: Any) -> Any:
    """NaN as null: JSON has no NaN."""
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [finite(v) for v in obj]
    return obj
