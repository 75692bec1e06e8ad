"""A replica's CPU per streamed token over its real data plane, beside a baseline, in one run.

    python benchmarks/bench_replica_path.py [--baseline REV] [--repeat 5] [--time-scale 1]

What runs, in one fresh process per measurement: what a replica actor runs outside Ray --
:class:`AsyncLLMEngine` over a cost-model engine (``sim:h100-8b``, steps that sleep for the
modelled GPU time times ``--time-scale``), its :class:`ZmqEventPublisher` and its
:class:`DataPlaneServer` on a real TCP socket -- and, in a second process, a front door's
side of the data plane: a DEALER that says HELLO, sends ``N`` requests at once (512-token
prompts, ``--tokens`` outputs each, EOS ignored) and reads every step's message until all
have finished. The figure is the replica process's CPU (``time.process_time``: every
thread, ZeroMQ's I/O thread included) from the first request's arrival to the last delta's
send, per output token. Ray's own threads are not in it (``bench_step_loop`` leaves the
socket out too; ``frontdoor_capacity`` measures the whole actor process under Ray).

``--baseline REV`` runs the same on another commit (a temporary ``git worktree``), run by
run interleaved with this tree's so that both see the same neighbours; ``--baseline-tree
DIR`` on a checkout already there (a machine without the repository's history). The default
``--time-scale`` 1 is a live replica's pace: the engine sleeps through each modelled step,
so the caches are cold when it wakes, as they are on a busy host.
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import time
from pathlib import Path

from bench_step_loop import _use_tree, interleaved, print_medians, run_worker

STREAMS = (1, 4, 16, 64)
PROMPT_TOKENS = 512


def client(endpoint: str, streams: int, tokens: int, first_id: int) -> None:
    """The front door's side: HELLO, ``streams`` requests, every delta until all finished."""
    import zmq

    from kvroute.events import dataplane_wire as dp
    from kvroute.events.replica_api import GenerateRequest, SamplingParams
    from kvroute.events.transport.sockets import configure_socket

    sock = zmq.Context.instance().socket(zmq.DEALER)
    configure_socket(sock)
    sock.connect(endpoint)
    sock.send_multipart((dp.HELLO, dp.encoder.encode(dp.Hello("bench"))))
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    for i in range(streams):
        rid = first_id + i
        prompt = [rid * 7 % 30_000 + k for k in range(PROMPT_TOKENS)]
        req = GenerateRequest(request_id=f"r{rid}", prompt_token_ids=prompt, sampling=params)
        sock.send_multipart((dp.ADD, dp.encoder.encode(req)))
    left, got = streams, 0
    while left:
        kind, payload = sock.recv_multipart()
        if kind != dp.OUTPUTS:
            continue
        for d in dp.decode_outputs(payload).deltas:
            got += len(d.delta_token_ids)
            if d.finished:
                left -= 1
                if d.error:
                    raise RuntimeError(d.error)
    if got != streams * tokens:
        raise RuntimeError(f"{got} tokens streamed, {streams * tokens} expected")
    print(got)


def measure(streams: int, tokens: int, time_scale: float, first_id: int, tree: str | None) -> float:
    """CPU microseconds per output token in the replica process, first arrival to last send."""
    from kvroute.events.transport import ZmqEventPublisher
    from kvroute.replica.engine.async_engine import AsyncLLMEngine
    from kvroute.replica.engine.llm_engine import EngineConfig, LLMEngine
    from kvroute.replica.serve.dataplane_server import DataPlaneServer

    publisher = ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="bench")
    config = EngineConfig(model="sim:h100-8b", time_scale=time_scale)
    engine = AsyncLLMEngine(LLMEngine(config, [publisher.publish]))
    server = DataPlaneServer(engine, "tcp://127.0.0.1:*", "bench")
    try:
        cmd = [sys.executable, __file__, "--client", server.endpoint, str(streams)]
        cmd += [str(tokens), str(first_id)] + (["--tree", tree] if tree else [])
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        while server.requests == 0:  # the clock starts when the first request is in
            if proc.poll() is not None:
                raise RuntimeError("the client ended before sending")
            time.sleep(0.0005)
        start = time.process_time()
        out, _ = proc.communicate(timeout=600)
        cpu = time.process_time() - start
        if proc.returncode != 0:
            raise RuntimeError(f"the client failed ({proc.returncode})")
    finally:
        server.close()
        engine.shutdown()
        publisher.close()
    return cpu * 1e6 / int(out.split()[-1])


def worker(args: argparse.Namespace) -> None:
    """One fresh process: a warm-up, then every stream count once; JSON on stdout."""
    measure(4, 32, args.time_scale, 1_000_000, args.tree)
    figures = {
        n: measure(n, args.tokens, args.time_scale, 1000 * n, args.tree) for n in args.streams
    }
    print(json.dumps(figures))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", metavar="REV", help="a commit to measure beside this tree")
    ap.add_argument(
        "--baseline-tree", metavar="DIR", help="a checkout to measure beside this tree (no git)"
    )
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=256, help="output tokens per stream")
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--streams", type=int, nargs="+", default=list(STREAMS))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--client", nargs=4, help=argparse.SUPPRESS)
    ap.add_argument("--tree", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tree:
        _use_tree(Path(args.tree))
    if args.client:
        endpoint, streams, tokens, first_id = args.client
        client(endpoint, int(streams), int(tokens), int(first_id))
        return
    if args.worker:
        worker(args)
        return

    runs = interleaved(args, functools.partial(run_worker, script=__file__), args.baseline_tree)
    print_medians(
        runs,
        args.streams,
        f"# replica CPU us per streamed token over the data plane, sim:h100-8b, "
        f"{PROMPT_TOKENS}-token prompts, {args.tokens} tokens each, "
        f"time_scale={args.time_scale:g}, median of {args.repeat}",
    )


if __name__ == "__main__":
    main()
