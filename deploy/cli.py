"""The ``kvroute`` command."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvroute",
        description="Multi-replica LLM serving with KV-cache-aware routing.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start replicas and the OpenAI-compatible front door")
    serve.add_argument("--model", default="smollm2-135m")
    serve.add_argument("--replicas", type=int, default=2)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--address", default=None, help="Ray cluster address (e.g. auto)")

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

    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "events":
        return _events(args)
    return _hash(args)


def _serve(args: argparse.Namespace) -> int:
    print(
        "kvroute serve: not available yet -- the engine, router and front door are still "
        "being built (only the event contract, kvroute.events, exists so far). "
        "See README.md for what works today.",
        file=sys.stderr,
    )
    return 2


def _hash(args: argparse.Namespace) -> int:
    from kvroute.events import DEFAULT_SEED, BlockHasher, to_external

    try:
        tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
        hasher = BlockHasher(args.algo, args.seed or DEFAULT_SEED, args.block_size)
    except ValueError as e:
        print(f"kvroute hash: {e}", file=sys.stderr)
        return 2
    for i, h in enumerate(hasher.hash_blocks(tokens, cache_salt=args.cache_salt)):
        ext = to_external(h, args.form)
        print(i, ext.hex() if isinstance(ext, bytes) else ext)
    return 0


def _events(args: argparse.Namespace) -> int:
    from kvroute.events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        ReplicaBatch,
        ZmqEventSubscriber,
    )

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


if __name__ == "__main__":
    sys.exit(main())
