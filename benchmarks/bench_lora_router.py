"""What naming a LoRA adapter adds to a request's path through the front door, one run.

    python benchmarks/bench_lora_router.py [--tokens 64,2048] [--reps 2000]

A request that names an adapter costs the router two things more than a base-model one:
resolving ``model`` (the registry and the tenant's grant: :meth:`LoRARegistry.resolve`)
and hashing its blocks with the adapter in every block's extra key
(:meth:`BlockHasher.hash_blocks` with ``lora_name``; under ``sha256_cbor_tagged`` the
adapter's folder too). Per hash algorithm and prompt length, both are timed side by side
with the base request's same steps, in CPU time of this process (``time.process_time``),
``--reps`` times each, alternating, and printed per request with the ratio. The front
door's budget (DESIGN.md) is 1 ms of CPU per request.
"""

from __future__ import annotations

import argparse
import random
import time

from kvroute.events import BlockHasher
from kvroute.router.fleet.tenants import Tenant
from kvroute.router.lora.registry import LoRARegistry


def per_request_us(fn: object, reps: int) -> float:
    t0 = time.process_time()
    for _ in range(reps):
        fn()  # type: ignore[operator]
    return (time.process_time() - t0) / reps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="64,2048", help="prompt lengths, comma-separated")
    ap.add_argument("--reps", type=int, default=2000)
    args = ap.parse_args()
    rng = random.Random(0)
    adapters = {f"adapter-{i}": f"/srv/adapters/adapter-{i}" for i in range(64)}
    registry = LoRARegistry({"base"}, adapters)
    tenant = Tenant("t", "salt", adapters=frozenset(list(adapters)[:8]))
    salt = "f" * 64
    print(f"{'algo':20} {'tokens':>6} {'base us':>9} {'adapter us':>11} {'ratio':>6}")
    for algo in ("xxh3_128", "sha256_cbor_tagged"):
        hasher = BlockHasher(algo, "seed", 16)
        for n in (int(t) for t in args.tokens.split(",")):
            ids = [rng.randrange(3, 50_000) for _ in range(n)]

            def base(hasher: BlockHasher = hasher, ids: list[int] = ids) -> None:
                hasher.hash_blocks(ids, cache_salt=salt)

            def lora(hasher: BlockHasher = hasher, ids: list[int] = ids) -> None:
                a = registry.resolve("adapter-3", tenant)
                assert a is not None
                hasher.hash_blocks(ids, cache_salt=salt, lora_name=a.name, lora_path=a.path)

            b = l_ = 0.0
            for _ in range(3):  # alternating rounds: the machine's load hits both alike
                b += per_request_us(base, args.reps) / 3
                l_ += per_request_us(lora, args.reps) / 3
            print(f"{algo:20} {n:>6} {b:>9.1f} {l_:>11.1f} {l_ / b:>6.2f}")


if __name__ == "__main__":
    main()
