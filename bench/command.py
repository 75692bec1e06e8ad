"""``kvroute bench`` and ``kvroute bench report``: arguments in, a table (and a JSON file) out.

Why a module of its own: :mod:`kvroute.deploy.cli` only declares the flags and imports this
lazily, so ``kvroute serve`` never pays for httpx or numpy it does not use; tests call
:func:`run_bench` and :func:`run_report` with parsed arguments, as the CLI does.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from .loadgen import Progress, error_examples, fetch_model, run_load
from .report import format_table, load_result, plot, summarize, to_json
from .sources import load_specs, plan, scale_lengths


def _say(msg: str) -> None:
    print(f"kvroute bench: {msg}", file=sys.stderr, flush=True)


def _check(args: argparse.Namespace) -> str | None:
    if not (args.trace or args.workload):
        return "give --trace FILE or --workload NAME (or: kvroute bench report FILE...)"
    if args.rate is not None and args.concurrency is not None:
        return "--rate and --concurrency exclude each other"
    if args.grace < 0:
        return "--grace must be >= 0"
    for name in ("max_requests", "concurrency", "vocab_size", "max_tokens"):
        v = getattr(args, name)
        if v is not None and v < 1:
            return f"--{name.replace('_', '-')} must be >= 1"
    for name in ("speed", "rate", "duration", "timeout", "length_scale"):
        v = getattr(args, name)
        if v is not None and v <= 0:
            return f"--{name.replace('_', '-')} must be > 0"
    if args.plot and not _has_matplotlib():
        return "--plot needs matplotlib (pip install 'kvroute[sim]')"
    return None


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def config_of(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """What the run was, for its JSON file (API keys only counted, never written)."""
    mode = (
        f"concurrency {args.concurrency}"
        if args.concurrency is not None
        else f"rate {args.rate}/s (Poisson)"
        if args.rate is not None
        else f"own timestamps / speed {args.speed}"
    )
    return {
        "url": args.url,
        "model": model,
        "source": args.trace or args.workload,
        "mode": mode,
        "speed": args.speed,
        "rate": args.rate,
        "concurrency": args.concurrency,
        "max_requests": args.max_requests,
        "duration_s": args.duration,
        "timeout_s": args.timeout,
        "prompt_format": args.prompt_format,
        "vocab_size": args.vocab_size,
        "length_scale": args.length_scale,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
        "api_keys": len(args.api_key or []),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def run_bench(args: argparse.Namespace) -> int:
    """One run: plan, send, summarize, print; 2 on bad arguments, 1 if nothing could be sent."""
    why = _check(args)
    if why:
        _say(why)
        return 2
    keys = list(args.api_key or [])
    try:
        specs = load_specs(args.trace, args.workload, args.max_requests, args.seed, args.speed)
        specs = [scale_lengths(s, args.length_scale, args.max_tokens) for s in specs]
    except (OSError, ValueError) as e:
        _say(str(e))
        return 2
    url = args.url.rstrip("/")
    model = args.model
    if model is None:
        try:
            model = asyncio.run(fetch_model(url, keys[0] if keys else None, args.timeout))
        except (httpx.HTTPError, ValueError, KeyError) as e:
            _say(f"cannot list models at {url}/models ({type(e).__name__}: {e}); give --model")
            return 1
    requests = plan(
        specs,
        model,
        keys=keys,
        prompt_format=args.prompt_format,
        vocab_size=args.vocab_size,
        rate=args.rate,
        closed_loop=args.concurrency is not None,
        seed=args.seed,
    )
    label = args.label or (args.trace and Path(args.trace).stem) or args.workload
    show = not args.no_progress
    if show:
        _say(f"{len(requests)} requests to {url} ({model}), {config_of(args, model)['mode']}")
    progress = Progress(len(requests), show)
    try:
        records, wall = asyncio.run(
            run_load(
                url,
                requests,
                concurrency=args.concurrency,
                duration=args.duration,
                grace=args.grace,
                timeout=args.timeout,
                on_done=progress.add,
            )
        )
    finally:
        progress.close()
    summary = summarize(records, wall, args.slo_ttft, args.slo_itl, args.slo_itl_stat)
    config = config_of(args, model)
    result = {"label": label, "config": config, "summary": summary, "records": records}
    print(format_table([result]))
    for kind, detail in error_examples(records).items():
        _say(f"{summary['errors'][kind]} x {kind}, e.g. {detail or '(no detail)'}")
    if args.json:
        Path(args.json).write_bytes(to_json(label, config, summary, records))
    if args.plot:
        plot([result], args.plot)
    return 0


def run_report(args: argparse.Namespace) -> int:
    """Several ``--json`` files side by side, and optionally their plot."""
    if args.plot and not _has_matplotlib():
        _say("--plot needs matplotlib (pip install 'kvroute[sim]')")
        return 2
    try:
        results = [load_result(p) for p in args.files]
    except (OSError, ValueError) as e:
        _say(str(e))
        return 2
    print(format_table(results))
    if args.plot:
        plot(results, args.plot)
    return 0
