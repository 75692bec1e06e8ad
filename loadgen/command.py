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

from kvroute.sim.workloads import DEFAULT_VOCAB

from .report import format_table, load_result, plot, summarize, to_json
from .sending import Breaker, Progress, describe_failure, error_examples, fetch_card, run_load
from .sources import fit_context, load_specs, plan, scale_lengths

# `kvroute bench` with no --trace or --workload: a quick look that fits a small CPU server.
QUICK_WORKLOAD, QUICK_REQUESTS, QUICK_CONCURRENCY, QUICK_MAX_TOKENS = "chat", 20, 4, 32
MAX_REQUESTS = 1000  # with --trace or --workload


def _say(msg: str) -> None:
    print(f"kvroute bench: {msg}", file=sys.stderr, flush=True)


def _check(args: argparse.Namespace) -> str | None:
    if args.rate is not None and args.concurrency is not None:
        return "--rate and --concurrency exclude each other"
    if args.grace < 0:
        return "--grace must be >= 0"
    if args.stop_after_errors < 0:
        return "--stop-after-errors must be >= 0"
    for name in ("max_requests", "concurrency", "vocab_size", "max_tokens", "max_model_len"):
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


def _run_fast(coro: Any) -> Any:
    """``asyncio.run`` on uvloop where it is installed (uvicorn[standard] brings it): the
    load generator's own loop costs less per chunk, so less of it lands in the latencies."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - a dependency of kvroute's server extra
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


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
        "max_model_len": args.max_model_len,
        "length_scale": args.length_scale,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
        "api_keys": len(args.api_key or []),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _quick_defaults(args: argparse.Namespace) -> str | None:
    """Fill in what was not given: a quick run without a source, else 1000 requests."""
    if args.trace or args.workload:
        if args.max_requests is None:
            args.max_requests = MAX_REQUESTS
        return None
    args.workload = QUICK_WORKLOAD
    said = [f"the {QUICK_WORKLOAD} workload"]
    if args.max_requests is None:
        args.max_requests = QUICK_REQUESTS
        said.append(f"{QUICK_REQUESTS} requests")
    if args.rate is None and args.concurrency is None:
        args.concurrency = QUICK_CONCURRENCY
        said.append(f"{QUICK_CONCURRENCY} at a time")
    if args.max_tokens is None:
        args.max_tokens = QUICK_MAX_TOKENS
        said.append(f"answers of at most {QUICK_MAX_TOKENS} tokens")
    return "no --trace or --workload: " + ", ".join(said)


def _tokenizer_facts(path: str) -> tuple[int, int | None, list[int]]:
    """Vocabulary size, context (None when the tokenizer does not say) and special ids of a
    local Hugging Face tokenizer folder."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    limit = getattr(tok, "model_max_length", None)
    context = int(limit) if isinstance(limit, int) and 0 < limit < 10**7 else None
    return len(tok), context, list(tok.all_special_ids)


class _CannotStartError(Exception):
    """Cannot start: the exit code and why."""

    def __init__(self, code: int, why: str) -> None:
        super().__init__(why)
        self.code = code


def _served_model(
    args: argparse.Namespace, url: str, key: str | None
) -> tuple[str, int, int | None, list[int], list[str]]:
    """(model, vocabulary size, context, ids to avoid, where each came from), flags first,
    then --tokenizer, then GET /v1/models."""
    card: dict[str, Any] = {}
    why = None
    try:
        card = asyncio.run(fetch_card(url, key, min(args.timeout, 30.0)))
    except httpx.ConnectError as e:  # nothing to load: --model would not help
        why = f"no server answers at {url} ({e or type(e).__name__})"
        raise _CannotStartError(1, why + "; is `kvroute serve` running there? (--url)") from None
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        why = f"cannot list models at {url}/models ({type(e).__name__}: {e})"
        if args.model is None:
            raise _CannotStartError(1, why + "; give --model") from None
    tok_vocab, tok_context, avoid = None, None, []
    if args.tokenizer:
        try:
            tok_vocab, tok_context, avoid = _tokenizer_facts(args.tokenizer)
        except (OSError, ValueError) as e:
            raise _CannotStartError(2, f"--tokenizer {args.tokenizer}: {e}") from None
    notes = [why] if why else []

    def pick(flag: Any, tok: Any, served: Any, what: str) -> Any:
        for value, source in ((flag, "flag"), (tok, "tokenizer"), (served, "/v1/models")):
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                notes.append(f"{what} {value} ({source})")
                return value
        return None

    model = args.model or card["id"]
    vocab = pick(args.vocab_size, tok_vocab, card.get("vocab_size"), "vocabulary")
    if vocab is None:
        vocab = DEFAULT_VOCAB
        notes.append(
            f"vocabulary size unknown: token ids below {vocab} "
            "(give --vocab-size or --tokenizer if the server's is smaller)"
        )
    context = pick(args.max_model_len, tok_context, card.get("max_model_len"), "context")
    return model, vocab, context, avoid, notes


def run_bench(args: argparse.Namespace) -> int:
    """One run: plan, send, summarize, print; 2 on bad arguments, 1 if nothing could be sent
    or the run stopped on repeated errors."""
    why = _check(args)
    if why:
        _say(why)
        return 2
    show = not args.no_progress
    quick = _quick_defaults(args)
    if quick:
        _say(quick)
    keys = list(args.api_key or [])
    url = args.url.rstrip("/")
    try:
        served = _served_model(args, url, keys[0] if keys else None)
    except _CannotStartError as e:
        _say(str(e))
        return e.code
    model, args.vocab_size, args.max_model_len, avoid, notes = served
    if show:
        _say(f"model {model}: " + "; ".join(notes))
    try:
        specs = load_specs(args.trace, args.workload, args.max_requests, args.seed, args.speed)
        specs = [scale_lengths(s, args.length_scale, args.max_tokens) for s in specs]
    except (OSError, ValueError) as e:
        _say(str(e))
        return 2
    if args.max_model_len is not None:
        fitted = [fit_context(s, args.max_model_len) for s in specs]
        cut = sum(a is not b for a, b in zip(specs, fitted, strict=True))
        if cut:
            _say(
                f"{cut} of {len(specs)} requests cut to fit the context of "
                f"{args.max_model_len} tokens (prompt tail first, answer to at most half)"
            )
        specs = fitted
    requests = plan(
        specs,
        model,
        keys=keys,
        prompt_format=args.prompt_format,
        vocab_size=args.vocab_size,
        avoid_ids=avoid,
        rate=args.rate,
        closed_loop=args.concurrency is not None,
        seed=args.seed,
    )
    label = args.label or (args.trace and Path(args.trace).stem) or args.workload
    if show:
        _say(f"{len(requests)} requests to {url} ({model}), {config_of(args, model)['mode']}")
    progress = Progress(len(requests), show)
    breaker = Breaker(args.stop_after_errors)
    try:
        records, wall = _run_fast(
            run_load(
                url,
                requests,
                concurrency=args.concurrency,
                duration=args.duration,
                grace=args.grace,
                timeout=args.timeout,
                on_done=progress.add,
                breaker=breaker,
                on_tick=progress.tick,
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
    if breaker.tripped and breaker.last is not None:
        _say(  # in a row: past --stop-after-errors when those in flight failed too
            f"stopped after {breaker.in_a_row} failed requests in a row ({wall:.1f} s; "
            f"--stop-after-errors {breaker.limit}); the last: {describe_failure(breaker.last)}"
        )
        return 1
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
