"""From a step's end until its outputs reach another process: hand-off against direct send.

    python benchmarks/bench_output_handoff.py [--model tiny|llama-8b|PATH] [--steps 60]

Two ways for a replica's step outputs to leave, side by side in one run:

- *thread hand-off* (the data plane before 2026-11-27, session 3): the engine thread writes
  a byte to a pipe that an I/O thread waits on (as it waited in ``zmq_poll``); that thread
  encodes the step's message and sends it. It wakes at once but runs Python only once it
  holds the GIL, which the engine thread gives up only when it blocks or when the switch
  interval (5 ms) forces it: on a GPU, whose eager forward holds the GIL while it launches
  kernels, every delta of the step waited that long.
- *direct send* (now, replica/serve/dataplane_server.py): the engine thread encodes the message and
  hands it to ZeroMQ itself, whose I/O thread is native and needs no GIL.

What runs: 64 sequences of 256 prompt tokens decode through ``LLMEngine.step`` in a loop;
each step's message (64 deltas of one token, msgspec-encoded) goes over a ZeroMQ PUSH
socket on loopback TCP to a receiver process, which stamps its arrival (``perf_counter``
is the system's monotonic clock: comparable across processes). The figure is arrival less
the step's end. Rounds alternate. ``llama-8b`` is bench_decode_step.py's 8B-shaped random
folder (on CUDA, its eager forward holds the GIL).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import zmq

from kvroute.events import dataplane_wire as dp
from kvroute.events.replica_api import GenerateDelta
from kvroute.replica import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_step import write_llama_8b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--receiver", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.receiver:
        run_receiver()
        return
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
    ctx = zmq.Context.instance()
    recv_cmd = [sys.executable, __file__, "--receiver"]
    receiver = subprocess.Popen(recv_cmd, stdout=subprocess.PIPE, text=True)
    port = int(receiver.stdout.readline())  # type: ignore[union-attr]
    endpoint = f"tcp://127.0.0.1:{port}"
    delta = GenerateDelta(request_id="r", delta_token_ids=[0], finished=False)
    message = dp.StepOutputs([delta] * 64)
    print(f"# {args.model}: 64 sequences, {args.steps} decode steps per round")
    print("| round | step ms | step end -> arrival p50 us | p90 us | max us |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for mode in ("thread hand-off", "direct send", "thread hand-off", "direct send"):
        sock = ctx.socket(zmq.PUSH)
        sock.connect(endpoint)
        stamp = [0.0]
        r, w = os.pipe()

        def send(when: float, sock: zmq.Socket = sock) -> None:
            sock.send_multipart((struct.pack("d", when), dp.encoder.encode(message)))

        def io_thread(r: int = r, stamp: list[float] = stamp) -> None:
            while True:
                select.select([r], [], [])
                os.read(r, 1)
                if stamp[0] < 0:
                    return
                send(stamp[0])

        thread = threading.Thread(target=io_thread) if mode == "thread hand-off" else None
        if thread is not None:
            thread.start()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
            stamp[0] = time.perf_counter()
            if thread is not None:
                os.write(w, b"x")
            else:
                send(stamp[0])
        step_ms = (time.perf_counter() - t0) / args.steps * 1e3
        if thread is not None:
            stamp[0] = -1.0
            os.write(w, b"x")
            thread.join()
        os.close(r)
        os.close(w)
        sock.send_multipart((b"end", b""))
        sock.close(linger=1000)
        waits = sorted(json.loads(receiver.stdout.readline()))  # type: ignore[union-attr]
        p50, p90 = waits[len(waits) // 2], waits[int(len(waits) * 0.9)]
        print(
            f"| {mode} | {step_ms:.1f} | {p50 * 1e6:.0f} | {p90 * 1e6:.0f} "
            f"| {waits[-1] * 1e6:.0f} |",
            flush=True,
        )
    receiver.terminate()


def run_receiver() -> None:
    """Binds a PULL socket (its port on stdout); per round, each arrival's delay as JSON."""
    sock = zmq.Context.instance().socket(zmq.PULL)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    print(port, flush=True)
    waits: list[float] = []
    while True:
        stamp, _ = sock.recv_multipart()
        if stamp == b"end":
            print(json.dumps(waits), flush=True)
            waits = []
            continue
        waits.append(time.perf_counter() - struct.unpack("d", stamp)[0])


if __name__ == "__main__":
    main()
