"""How long a step's outputs wait for the replica's I/O thread: the GIL hand-off, measured.

    python benchmarks/bench_output_handoff.py [--model tiny|llama-8b|PATH] [--steps 60]

A replica's engine thread ends each step by handing the deltas to its data-plane I/O thread
(a queue and a pipe, replica/dataplane.py) and goes straight on to the next step. The I/O
thread wakes from its poll at once, but runs Python only once it holds the GIL, which the
engine thread gives up only when it blocks or when the switch interval (5 ms) forces it.
Every delta of the step waits that long before it leaves the process.

What runs: 64 sequences of 256 prompt tokens decode through ``LLMEngine.step`` in a loop;
after each step the loop writes a byte to a pipe that a second thread waits on with
``select`` (as the I/O thread waits in ``zmq_poll``) and stamps the time; the second thread
records how long after the write it ran Python. Four rounds: plain, then with a
``time.sleep(0)`` after the write (a voluntary GIL release), twice each. ``llama-8b`` is
bench_decode_step.py's 8B-shaped random folder (CUDA: its eager forward holds the GIL).
"""

from __future__ import annotations

import argparse
import os
import random
import select
import sys
import tempfile
import threading
import time
from pathlib import Path

from kvroute.replica import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_step import write_llama_8b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    model = args.model
    if model == "llama-8b":
        model = str(write_llama_8b(Path(tempfile.gettempdir()) / "kvroute-llama-8b-rand"))
    engine = LLM(model, max_num_batched_tokens=8192).llm_engine
    vocab = engine.runner.model.config.vocab_size
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=5 * args.steps + 50, ignore_eos=True)
    for i in range(64):
        engine.add_request(str(i), [rng.randrange(3, vocab - 8) for _ in range(256)], params)
    for _ in range(5):
        engine.step()
    print(f"# {args.model}: 64 sequences, {args.steps} decode steps per round")
    print("| round | step ms | hand-off p50 us | p90 us | max us |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for mode in ("plain", "sleep(0) after the write", "plain", "sleep(0) after the write"):
        r, w = os.pipe()
        waits: list[float] = []
        stamp = [0.0]

        def io_thread(r: int = r, waits: list[float] = waits, stamp: list[float] = stamp) -> None:
            while True:
                select.select([r], [], [])
                os.read(r, 1)
                if stamp[0] < 0:
                    return
                waits.append(time.perf_counter() - stamp[0])

        thread = threading.Thread(target=io_thread)
        thread.start()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
            stamp[0] = time.perf_counter()
            os.write(w, b"x")
            if mode != "plain":
                time.sleep(0)
        step_ms = (time.perf_counter() - t0) / args.steps * 1e3
        stamp[0] = -1.0
        os.write(w, b"x")
        thread.join()
        os.close(r)
        os.close(w)
        waits.sort()
        p50, p90 = waits[len(waits) // 2], waits[int(len(waits) * 0.9)]
        print(
            f"| {mode} | {step_ms:.1f} | {p50 * 1e6:.0f} | {p90 * 1e6:.0f} "
            f"| {waits[-1] * 1e6:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
