"""A replica's CPU per streamed token outside the model, beside a baseline, in one run.

    python benchmarks/bench_step_loop.py [--baseline REV] [--repeat 5] [--time-scale 1e-6]

What runs: the replica's engine thread as it is (:class:`AsyncLLMEngine` over a cost-model
engine, ``sim:h100-8b``, whose steps sleep for the modelled GPU time scaled by
``--time-scale``) with each front door's sink (:class:`_FrontDoorSink`) whose step message is
encoded with msgspec (``StepOutputs``) as the data plane would, then dropped:
everything a replica does per step except socket I/O and wake-ups. ``N`` streams start at
once (512-token prompts, ``--tokens`` outputs each, EOS ignored); the figure is the process's
CPU time (``time.process_time``, all threads) from the first submit to the last delta, per
output token, so it also carries each request's intake and prefill bookkeeping. Median of
``--repeat`` runs, each in a fresh process.

``--baseline REV``: the same measurement on another commit (a temporary ``git worktree``),
run by run interleaved with this tree's so that both see the same neighbours. The default
``--time-scale`` (1e-6) leaves no sleep in a step: the engine's Python runs back to back.
With 1 (the modelled GPU time) the figures are those of a live replica, higher on a machine
whose caches go cold while a step sleeps.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
STREAMS = (1, 4, 16, 64)
PROMPT_TOKENS = 512


def _use_tree(root: Path) -> None:
    """Imports ``kvroute.*`` from the checkout at ``root`` (how the editable install maps it)."""
    import importlib.util
    import types

    pkg = types.ModuleType("kvroute")
    pkg.__path__ = []
    sys.modules["kvroute"] = pkg
    for name in ("events", "kernels", "replica"):
        spec = importlib.util.spec_from_file_location(
            f"kvroute.{name}", root / name / "__init__.py", submodule_search_locations=[]
        )
        assert spec is not None and spec.loader is not None
        spec.submodule_search_locations = [str(root / name)]
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        setattr(pkg, name, module)
        spec.loader.exec_module(module)


def measure(streams: int, tokens: int, time_scale: float, first_id: int) -> float:
    """CPU microseconds per output token of ``streams`` concurrent requests, start to end."""
    from kvroute.events import dataplane_wire as dp
    from kvroute.events.replica_api import SamplingParams
    from kvroute.replica.engine.async_engine import AsyncLLMEngine
    from kvroute.replica.engine.llm_engine import EngineConfig, LLMEngine
    from kvroute.replica.serve.dataplane_server import _FrontDoorSink

    class EncodingServer:
        """The data plane's share without the socket: one encoded message per step."""

        def __init__(self) -> None:
            self.tokens = 0
            self.left = streams
            self.done = threading.Event()

        def send_outputs(self, client: bytes, deltas: list[Any]) -> None:
            dp.encoder.encode(dp.StepOutputs(deltas))
            for d in deltas:
                self.tokens += len(d.delta_token_ids)
                self.left -= d.finished
            if self.left == 0:
                self.done.set()

        enqueue = send_outputs  # what a tree before the engine thread sent itself calls

    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model="sim:h100-8b", time_scale=time_scale)))
    try:
        server = EncodingServer()
        sink = _FrontDoorSink(server, b"front-door")  # type: ignore[arg-type]
        params = SamplingParams(max_tokens=tokens, ignore_eos=True)
        prompts = [
            [(first_id + i) * 7 % 30_000 + k for k in range(PROMPT_TOKENS)] for i in range(streams)
        ]
        start = time.process_time()
        for i, prompt in enumerate(prompts):
            engine.submit(f"r{first_id + i}", prompt, params, sink)
        if not server.done.wait(600):
            raise RuntimeError("the engine did not finish")
        cpu = time.process_time() - start
    finally:
        engine.shutdown()
    if server.tokens != streams * tokens:
        raise RuntimeError(f"{server.tokens} tokens streamed, {streams * tokens} expected")
    return cpu * 1e6 / server.tokens


def worker(args: argparse.Namespace) -> None:
    """One fresh process: a warm-up, then every stream count once; JSON on stdout."""
    if args.tree:
        _use_tree(Path(args.tree))
    measure(4, 32, args.time_scale, 1_000_000)  # imports, tokenizer, allocator warm-up
    figures = {n: measure(n, args.tokens, args.time_scale, 1000 * n) for n in args.streams}
    print(json.dumps(figures))


def run_worker(
    tree: Path | None, args: argparse.Namespace, script: str = __file__
) -> dict[int, float]:
    """One ``--worker`` run of ``script`` (this file, or another built on it) in a fresh
    process, on ``tree`` (None: this checkout): its figure per stream count."""
    cmd = [sys.executable, script, "--worker", "--tokens", str(args.tokens)]
    cmd += ["--time-scale", repr(args.time_scale), "--streams", *map(str, args.streams)]
    if tree is not None:
        cmd += ["--tree", str(tree)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return {int(k): v for k, v in json.loads(out.splitlines()[-1]).items()}


def baseline_tree(rev: str, into: Path, name: str = "tree") -> Path:
    """A checkout of ``rev`` at ``into/name`` (a ``git worktree``), with this tree's compiled
    hashing accelerator if it lacks one (otherwise the baseline's prefill would hash in pure
    Python)."""
    tree = into / name
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev],
        check=True,
        capture_output=True,
    )
    for so in (ROOT / "events").glob("_chain*.so"):
        if not (tree / "events" / so.name).exists():
            shutil.copy2(so, tree / "events" / so.name)
    return tree


def interleaved(
    args: argparse.Namespace,
    run_worker: Callable[[Path | None, argparse.Namespace], dict[int, float]],
    baseline_dir: str | None = None,
) -> dict[str, list[dict[int, float]]]:
    """``args.repeat`` runs of this tree, each after one of the baseline when there is one
    (``args.baseline``: a commit, checked out in a temporary worktree; ``baseline_dir``: a
    checkout already there), so that both see the same neighbours."""
    runs: dict[str, list[dict[int, float]]] = {"this tree": []}
    with tempfile.TemporaryDirectory(prefix="bench-ab-") as tmp:
        base: Path | None = None
        if baseline_dir:
            base, label = Path(baseline_dir).resolve(), baseline_dir
        elif args.baseline:
            base, label = baseline_tree(args.baseline, Path(tmp)), args.baseline
        if base is not None:
            runs = {f"baseline {label}": [], "this tree": []}
        try:
            for i in range(args.repeat):
                print(f"# round {i + 1}/{args.repeat}", file=sys.stderr, flush=True)
                if base is not None:
                    runs[f"baseline {label}"].append(run_worker(base, args))
                runs["this tree"].append(run_worker(None, args))
        finally:
            if base is not None and not baseline_dir:
                subprocess.run(
                    ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)],
                    check=False,
                    capture_output=True,
                )
    return runs


def print_medians(runs: dict[str, list[dict[int, float]]], streams: list[int], title: str) -> None:
    """One line per stream count: each tree's median, and this tree's over the baseline's."""
    print(title)
    names = list(runs)
    print(f"{'streams':>8} " + " ".join(f"{n:>22}" for n in names) + ("  ratio" * (len(names) > 1)))
    for n in streams:
        med = [statistics.median(r[n] for r in runs[name]) for name in names]
        line = f"{n:>8} " + " ".join(f"{m:>22.1f}" for m in med)
        if len(med) > 1:
            line += f"  {med[-1] / med[0]:5.2f}"
        print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", metavar="REV", help="a commit to measure beside this tree")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=256, help="output tokens per stream")
    ap.add_argument("--time-scale", type=float, default=1e-6)
    ap.add_argument("--streams", type=int, nargs="+", default=list(STREAMS))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tree", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    runs = interleaved(args, run_worker)
    print_medians(
        runs,
        args.streams,
        f"# CPU us per streamed token, sim:h100-8b, {PROMPT_TOKENS}-token prompts, "
        f"{args.tokens} tokens each, time_scale={args.time_scale:g}, median of {args.repeat}",
    )


if __name__ == "__main__":
    main()
