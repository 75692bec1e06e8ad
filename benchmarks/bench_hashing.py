"""Block hashing speed: kvroute's algorithms beside a naive per-block baseline, one run.

    python benchmarks/bench_hashing.py [--repeat N]

The baseline hashes each block the way vLLM's default Python-object hashing does:
``hashlib.sha256(pickle.dumps((parent, tuple(tokens), extra)))``. ``xxh3_128`` is timed twice,
pure Python and with the compiled chain loop (``kvroute.events._chain``), after checking that
both give the same bytes; the accelerated row is marked "not built" when the extension is
missing.
"""

from __future__ import annotations

import argparse
import hashlib
import pickle
import platform
import random
import time
from collections.abc import Callable

from kvroute.events import BlockHasher


def naive(tokens: list[int], block_size: int) -> list[bytes]:
    """vLLM-default-shaped hashing: one pickle + SHA-256 per block."""
    parent, out = hashlib.sha256(pickle.dumps("seed")).digest(), []
    for i in range(len(tokens) // block_size):
        blk = tuple(tokens[i * block_size : (i + 1) * block_size])
        parent = hashlib.sha256(pickle.dumps((parent, blk, None))).digest()
        out.append(parent)
    return out


def best_time(fn: Callable[[], object], repeat: int) -> float:
    """Best wall time of ``repeat`` calls after one warm-up: the least disturbed by neighbours."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    bs = args.block_size
    print(
        f"# {platform.processor() or platform.machine()}, Python {platform.python_version()}, "
        f"block_size={bs}, best of {args.repeat}"
    )
    print(
        f"{'prompt':>8} {'algorithm':>12} {'ms/prompt':>10} {'blocks/s':>12} {'tokens/s':>13}"
        f" {'vs naive':>9}"
    )
    rng = random.Random(0)
    for n in (2048, 32768):
        tokens = [rng.randrange(151_936) for _ in range(n)]
        # Same number of runs for every row: a best-of over fewer runs would flatter the others.
        t_naive = best_time(lambda t=tokens: naive(t, bs), args.repeat)
        rows: list[tuple[str, float | None]] = [("naive", t_naive)]
        pure = BlockHasher("xxh3_128", block_size=bs, accelerate=False)
        rows.append(
            ("xxh3_128 py", best_time(lambda h=pure, t=tokens: h.hash_blocks(t), args.repeat))
        )
        try:
            fast: BlockHasher | None = BlockHasher("xxh3_128", block_size=bs, accelerate=True)
        except ImportError:
            fast = None
        if fast is not None:
            if fast.hash_blocks(tokens) != pure.hash_blocks(tokens):
                raise SystemExit("accelerated xxh3_128 disagrees with the pure path")
            rows.append(
                ("xxh3_128 C", best_time(lambda h=fast, t=tokens: h.hash_blocks(t), args.repeat))
            )
        else:
            rows.append(("xxh3_128 C", None))
        sha = BlockHasher("sha256_cbor", block_size=bs)
        rows.append(
            ("sha256_cbor", best_time(lambda h=sha, t=tokens: h.hash_blocks(t), args.repeat))
        )
        for name, t in rows:
            if t is None:
                print(f"{n:>8} {name:>12} {'not built':>10}")
                continue
            print(
                f"{n:>8} {name:>12} {t * 1e3:>10.4f} {n // bs / t:>12,.0f} {n / t:>13,.0f}"
                f" {t_naive / t:>8.1f}x"
            )


if __name__ == "__main__":
    main()
