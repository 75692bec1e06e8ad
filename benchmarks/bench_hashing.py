"""Block hashing speed: kvroute's algorithms beside a naive per-block baseline, one run.

    python benchmarks/bench_hashing.py [--repeat N]

The baseline hashes each block the way vLLM's default Python-object hashing does:
``hashlib.sha256(pickle.dumps((parent, tuple(tokens), extra)))``.
"""

from __future__ import annotations

import argparse
import hashlib
import pickle
import platform
import random
import time

from kvroute.events import BlockHasher


def naive(tokens: list[int], block_size: int) -> list[bytes]:
    parent, out = hashlib.sha256(pickle.dumps("seed")).digest(), []
    for i in range(len(tokens) // block_size):
        blk = tuple(tokens[i * block_size : (i + 1) * block_size])
        parent = hashlib.sha256(pickle.dumps((parent, blk, None))).digest()
        out.append(parent)
    return out


def best_time(fn, repeat: int) -> float:
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
        t_naive = best_time(lambda t=tokens: naive(t, bs), max(3, args.repeat // 5))
        rows = [("naive", t_naive)]
        for algo in ("xxh3_128", "sha256_cbor"):
            h = BlockHasher(algo, block_size=bs)
            rows.append((algo, best_time(lambda h=h, t=tokens: h.hash_blocks(t), args.repeat)))
        for name, t in rows:
            print(
                f"{n:>8} {name:>12} {t * 1e3:>10.3f} {n // bs / t:>12,.0f} {n / t:>13,.0f}"
                f" {t_naive / t:>8.1f}x"
            )


if __name__ == "__main__":
    main()
