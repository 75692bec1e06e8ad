"""The ``kvroute`` command."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from kvroute.events.torch_wheels import hide_broken

    hide_broken()  # before any command reads a model's config or tokenizer
    args = build_parser().parse_args(argv)
    _console_logging(args.command)
    if args.command == "serve":
        return _serve(args)
    if args.command == "router":
        from .router import run as run_router

        return run_router(args)
    if args.command == "stop":
        from .stop import stop as stop_fleet

        return stop_fleet(args)
    if args.command == "scale":
        from .scale import run as run_scale

        return run_scale(args)
    if args.command == "events":
        return _events(args)
    if args.command == "simulate":
        from .simulate_cli import run as run_simulate

        return run_simulate(args)
    if args.command == "bench":
        return _bench(args)
    if args.command == "key":
        return _key(args)
    return _hash(args)


def _console_logging(command: str) -> None:
    """kvroute's own warnings on stderr in the command's voice (``kvroute serve: warning:
    ...``), like its progress lines; without a handler Python prints the bare message."""
    import logging

    class _Lower(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            return f"kvroute {command}: {record.levelname.lower()}: {super().format(record)}"

    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(_Lower("%(message)s"))
    logging.getLogger("kvroute").addHandler(handler)
    if not sys.stderr.isatty():
        # Replicas' lines reach this console through Ray with a "(ReplicaServer pid=...)"
        # prefix; colour codes in it would litter a log file. Ray reads this when it prints.
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand's arguments (tests check deploy files' command lines against it)."""
    parser = argparse.ArgumentParser(
        prog="kvroute",
        description="Multi-replica LLM serving with KV-cache-aware routing.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    from .serve_args import add_arguments

    serve = sub.add_parser("serve", help="start replicas and the OpenAI-compatible front door")
    add_arguments(serve)

    watch = sub.add_parser(
        "events", help="print a replica's (or a vLLM engine's) KV-event stream as it arrives"
    )
    watch.add_argument("endpoint", help="PUB endpoint, e.g. tcp://127.0.0.1:5557")
    watch.add_argument("--replay", default=None, help="replay endpoint, e.g. tcp://127.0.0.1:5558")
    watch.add_argument("--topic", default="")
    watch.add_argument("--count", type=int, default=0, help="stop after N batches (0: never)")

    hash_cmd = sub.add_parser("hash", help="print the block hashes of a list of token ids")
    hash_cmd.add_argument("tokens", help="comma-separated token ids")
    hash_cmd.add_argument("--algo", default="xxh3_128")
    hash_cmd.add_argument("--seed", default=None)
    hash_cmd.add_argument("--block-size", type=int, default=16)
    hash_cmd.add_argument("--cache-salt", default=None)
    hash_cmd.add_argument("--form", choices=("bytes", "int"), default="bytes")
    hash_cmd.add_argument(
        "--long-prompt-after",
        type=int,
        default=None,
        help="the replicas' rotary switch (ReplicaInfo.long_prompt_after; longrope models): a "
        "longer prompt is hashed with its regime's salt, as they hash it",
    )

    key = sub.add_parser(
        "key",
        help="make a new API key and print it with the hash a tenants file stores",
        description="Prints a new random API key (give it to the tenant) and its "
        "'sha256:...' hash (put that in the tenants file's keys). With --hash, reads an "
        "existing key from standard input and prints only its hash.",
    )
    key.add_argument("--hash", action="store_true", help="hash a key read from stdin")

    from .router_args import add_arguments as add_router_arguments

    router = sub.add_parser(
        "router", help="one more front door for a running fleet (joins its Ray cluster)"
    )
    add_router_arguments(router)

    stop = sub.add_parser("stop", help="stop every replica of a fleet on a Ray cluster")
    from .router_args import add_stop_arguments

    add_stop_arguments(stop)

    from .scale import add_arguments as add_scale_arguments

    scale = sub.add_parser(
        "scale",
        help="grow or shrink a running fleet (new replicas like the others; retired ones "
        "drained first)",
    )
    add_scale_arguments(scale)

    from .simulate_cli import add_parser as add_simulate

    add_simulate(sub)
    _add_bench(sub)

    return parser


def _add_bench(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser(
        "bench",
        help="HTTP load generator for an OpenAI-compatible server (kvroute, vLLM, SGLang)",
        description="Streams /v1/completions requests from a Mooncake trace or a built-in "
        "workload and reports TTFT (to the first content chunk), inter-token latency (gaps "
        "between content chunks), e2e latency, throughput, goodput, "
        "the fleet's prefix-cache hit rate, errors by kind and requests per replica. "
        "`kvroute bench report A.json B.json ...` sets saved runs side by side.",
    )
    src = bench.add_mutually_exclusive_group()
    src.add_argument("--trace", help="Mooncake jsonl trace (timestamp, hash_ids, ...)")
    src.add_argument(
        "--workload",
        choices=("tenants", "chat", "rag", "agents"),
        help="with neither this nor --trace: chat, 20 requests, 4 at a time, answers of at "
        "most 32 tokens (each overridable)",
    )
    bench.add_argument("--url", default="http://127.0.0.1:8000/v1", help="API base URL")
    bench.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    bench.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="a local Hugging Face tokenizer folder: the vocabulary size, context and special "
        "ids (not sent) of a server whose /v1/models does not give them",
    )
    bench.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="repeatable; each distinct cache_salt (else request index) is sent with one "
        "key, chosen deterministically",
    )
    pace = bench.add_mutually_exclusive_group()
    pace.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second")
    pace.add_argument(
        "--concurrency", type=int, default=None, help="closed loop: C requests in flight"
    )
    bench.add_argument(
        "--speed", type=float, default=1.0, help="own timestamps divided by this (default 1)"
    )
    bench.add_argument(
        "--max-requests", type=int, default=None, help="default 1000 (20 without a source)"
    )
    bench.add_argument(
        "--duration",
        type=float,
        default=None,
        help="stop sending after S seconds; in-flight requests get --grace, then are "
        "cancelled (counted as `cancelled`)",
    )
    bench.add_argument("--grace", type=float, default=10.0, help="seconds (default 10)")
    bench.add_argument("--timeout", type=float, default=300.0, help="per request, s")
    bench.add_argument(
        "--prompt-format",
        choices=("tokens", "text"),
        default="tokens",
        help="tokens: token-id lists (exact on any server); text: one printable ASCII "
        "character per token id (32-126 as themselves): the byte-level `tiny` model reads "
        "back as many tokens and the same shared prefixes; other tokenizers merge "
        "characters, so their token counts are not exact",
    )
    bench.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="token ids < this (default: from /v1/models or --tokenizer, else 128256)",
    )
    bench.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="the context: longer requests are cut to fit (default: from /v1/models or "
        "--tokenizer, else no cut)",
    )
    bench.add_argument(
        "--stop-after-errors",
        type=int,
        default=10,
        metavar="N",
        help="stop when N requests in a row failed, printing the server's message "
        "(default 10; 0: never)",
    )
    bench.add_argument(
        "--length-scale",
        type=float,
        default=1.0,
        help="multiply every prompt segment's length (shared prefixes stay shared): "
        "the workloads at a size a small model serves",
    )
    bench.add_argument(
        "--max-tokens", type=int, default=None, help="cap each request's output length"
    )
    bench.add_argument("--seed", type=int, default=0, help="workload and --rate seed")
    bench.add_argument("--slo-ttft", type=float, default=2.0, help="goodput SLO: TTFT (s)")
    bench.add_argument(
        "--slo-itl", type=float, default=0.1, help="goodput SLO: a request's own ITL (s)"
    )
    bench.add_argument(
        "--slo-itl-stat",
        choices=("p90", "mean"),
        default="p90",
        help="which of a request's ITLs --slo-itl applies to (default p90)",
    )
    bench.add_argument("--label", default=None, help="the run's name in tables and plots")
    bench.add_argument("--json", default=None, metavar="FILE", help="write the full result")
    bench.add_argument("--plot", default=None, metavar="FILE.png", help="needs matplotlib")
    bench.add_argument("--no-progress", action="store_true", help="no progress on stderr")
    more = bench.add_subparsers(dest="bench_command")
    report = more.add_parser("report", help="saved runs (--json files) side by side")
    report.add_argument("files", nargs="+", metavar="FILE.json")
    report.add_argument("--plot", default=None, metavar="FILE.png", help="needs matplotlib")


def _bench(args: argparse.Namespace) -> int:
    from kvroute.loadgen.command import run_bench, run_report

    if args.bench_command == "report":
        return run_report(args)
    return run_bench(args)


def _serve(args: argparse.Namespace) -> int:
    from .serve import run

    return run(args)


def _key(args: argparse.Namespace) -> int:
    import secrets

    from kvroute.router.fleet.tenants import hash_key

    if args.hash:
        key = sys.stdin.readline().strip()
        if not key:
            print("kvroute key: no key on standard input", file=sys.stderr)
            return 2
        print(hash_key(key))
        return 0
    key = "kvr-" + secrets.token_urlsafe(32)
    print(f"key:  {key}\nhash: {hash_key(key)}")
    return 0


def _hash(args: argparse.Namespace) -> int:
    from kvroute.events import DEFAULT_SEED, BlockHasher, regime_salt, to_external

    try:
        tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
        hasher = BlockHasher(args.algo, args.seed or DEFAULT_SEED, args.block_size)
    except ValueError as e:
        print(f"kvroute hash: {e}", file=sys.stderr)
        return 2
    salt = regime_salt(args.cache_salt, len(tokens), args.long_prompt_after)
    for i, h in enumerate(hasher.hash_blocks(tokens, cache_salt=salt)):
        ext = to_external(h, args.form)
        print(i, ext.hex() if isinstance(ext, bytes) else ext)
    return 0


def _events(args: argparse.Namespace) -> int:
    from kvroute.events import AllBlocksCleared, BlockRemoved, BlockStored
    from kvroute.events.transport import ReplicaBatch, ZmqEventSubscriber

    done = threading.Event()
    seen = 0

    def show(item: ReplicaBatch) -> None:
        nonlocal seen
        stored = sum(len(e.block_hashes) for e in item.batch.events if isinstance(e, BlockStored))
        removed = sum(len(e.block_hashes) for e in item.batch.events if isinstance(e, BlockRemoved))
        cleared = any(isinstance(e, AllBlocksCleared) for e in item.batch.events)
        print(
            f"seq={item.seq} source={item.source} stored={stored} removed={removed}"
            + (" cleared" if cleared else ""),
            flush=True,
        )
        seen += 1
        if args.count and seen >= args.count:
            done.set()

    sub = ZmqEventSubscriber(show)
    sub.add_publisher("replica", args.endpoint, args.replay, args.topic)
    signal.signal(signal.SIGINT, lambda *_: done.set())
    done.wait()
    stats = sub.stats().get("replica")
    sub.close()
    if stats is not None:
        print(f"# {stats}", file=sys.stderr)
    return 0


def entry() -> None:
    """The console script: :func:`main`, then an exit that skips the interpreter's teardown
    where Triton was imported (torch's compiler imports it wherever it is installed: GPU
    machines, the ``structured`` extra). Triton 3.x's nanobind bindings print some 600
    lines of "leaked" warnings at teardown, after ``kvroute serve: stopped``, whatever the
    command did. Exit handlers (Ray's shutdown among them) still run, and stdio is flushed,
    first. Tests call :func:`main`, which returns."""
    code = main()
    if "triton" not in sys.modules:
        sys.exit(code)
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more to say
            pass
    os._exit(code or 0)


if __name__ == "__main__":
    entry()
