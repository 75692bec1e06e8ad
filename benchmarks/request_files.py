"""Which of kvroute's files one chat request crosses in the front door (issue 52's path goal).

A real front door (FastAPI under uvicorn, in this process, flow control on as
``kvroute serve`` runs it by default) in front of one real replica actor of ``tiny`` (Ray,
its own process), as ``tests/router/api/conftest.py`` builds it. After two warm-up
requests, every Python call made in this process while one chat request
is served (``stream`` false, then true) is recorded by a profile hook on every thread, and
only calls into kvroute's own files count. Printed per request:

- **files**: the distinct kvroute files it ran code in;
- **stops**: the sequence of files in call order, consecutive repeats merged (a call from
  a file into itself is not a stop);
- **returns**: stops at a file already visited earlier in the sequence;
- **call-backs**: calls into a file that is already on the call stack beneath another
  file (module A calls B, which calls back into A): the issue asks for none.

The replica's own path runs in its actor process and is not traced here.

    python benchmarks/request_files.py [--list] [--functions]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
Call = tuple[int, str, str, bool, str]
SKIP = ("/tests/", "/benchmarks/")


class Tracer:
    """A profile hook for every thread, recording calls into kvroute's files while on."""

    def __init__(self) -> None:
        self.on = False
        self.calls: list[Call] = []  # thread, file, function, call-back, root
        self._ours: dict[str, str | None] = {}

    def _file(self, path: str) -> str | None:
        rel = self._ours.get(path)
        if rel is None and path not in self._ours:
            if path.startswith("<"):  # frozen modules, generated code
                self._ours[path] = None
                return None
            real = os.path.realpath(path)
            inside = real.startswith(str(ROOT) + os.sep) and not any(s in real for s in SKIP)
            rel = os.path.relpath(real, ROOT) if inside else None
            self._ours[path] = rel
        return rel

    def hook(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.on or event != "call":
            return
        rel = self._file(frame.f_code.co_filename)
        if rel is None:
            return
        back = frame.f_back
        seen_other = False
        callback = False
        root = f"{rel}:{frame.f_code.co_name}"  # the outermost of our frames beneath it
        while back is not None:  # is this file on the stack beneath another of ours?
            other = self._file(back.f_code.co_filename)
            if other is not None:
                root = f"{other}:{back.f_code.co_name}"
                if other != rel:
                    seen_other = True
                elif seen_other:
                    callback = True
            back = back.f_back
        self.calls.append((threading.get_ident(), rel, frame.f_code.co_name, callback, root))


# Work on the event loop that is not this request's: event ingest (the subscriber's task,
# and the index updates it makes) and the periodic load and health checks.
BACKGROUND = (
    "events/transport/",
    "router/fleet/membership.py",
    "router/fleet/fleet_monitor.py",
)


def split(calls: list[Call], loop: int) -> tuple[list[Call], list[Call], Counter[str]]:
    """The request's calls (on the event loop, from any root but the background ones),
    everything else, and the roots seen with their call counts."""
    roots = Counter(c[4] for c in calls)
    own = [c for c in calls if c[0] == loop and not c[4].startswith(BACKGROUND)]
    return own, [c for c in calls if c not in own], roots


def summarize(calls: list[Call]) -> dict[str, Any]:
    stops: list[str] = []
    for _, rel, _, _, _ in calls:
        if not stops or stops[-1] != rel:
            stops.append(rel)
    seen: set[str] = set()
    returns = 0
    for rel in stops:
        returns += rel in seen
        seen.add(rel)
    callbacks = Counter((rel, fn) for _, rel, fn, cb, _ in calls if cb)
    functions: dict[str, Counter[str]] = {}
    for _, rel, fn, _, _ in calls:
        functions.setdefault(rel, Counter())[fn] += 1
    return {
        "files": sorted(seen),
        "stops": stops,
        "returns": returns,
        "callbacks": callbacks,
        "functions": functions,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="print each request's stops")
    ap.add_argument("--functions", action="store_true", help="print the functions run per file")
    args = ap.parse_args()
    tracer = Tracer()
    threading.setprofile(tracer.hook)  # threads started from here on (uvicorn's included)
    sys.setprofile(tracer.hook)

    import httpx
    import ray
    import uvicorn

    from kvroute.deploy.http_server import uvicorn_config
    from kvroute.replica.serve.actor import start_replica
    from kvroute.router.api.app import create_app
    from kvroute.router.fleet.flow import DEFAULT_DEPTH
    from kvroute.router.fleet.tenants import Tenants, tenants_from_api_keys
    from kvroute.router.frontdoor import FrontDoor

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        actor = start_replica(
            "r0", {"model": "tiny", "block_size": 16, "num_blocks": 160}, num_cpus=0.5,
            torch_threads=1,
        )  # fmt: skip
        info = ray.get(actor.info.remote(), timeout=120)
        # Flow control on, at its depth by default in ``kvroute serve``, as users run it.
        door = FrontDoor([(actor, info)], monitor_interval_s=0.5, flow_depth=DEFAULT_DEPTH)
        app = create_app(door, Tenants(tenants_from_api_keys({"key": "t"}), "secret", None))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = uvicorn.Server(uvicorn_config(app, host="127.0.0.1", port=port))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        assert thread.ident is not None
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        headers = {"Authorization": "Bearer key"}

        def chat(stream: bool) -> None:
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": "Say something about routers."}],
                "max_tokens": 8,
                "stream": stream,
            }
            with httpx.Client(timeout=60) as client:
                r = client.post(url, json=body, headers=headers)
                assert r.status_code == 200, r.text

        for stream in (False, True, False, True):  # warm-up: imports, first-call paths
            chat(stream)
        print("| request | thread | files | stops | returns | call-backs |")
        print("| --- | --- | ---: | ---: | ---: | ---: |")
        results = {}
        for stream in (False, True):
            tracer.calls.clear()
            tracer.on = True
            chat(stream)
            time.sleep(0.2)  # the stream's last bookkeeping after the client has its answer
            tracer.on = False
            own, others, roots = split(list(tracer.calls), thread.ident)
            if args.list:
                print(f"roots: {dict(roots)}")
            name = "chat, stream" if stream else "chat"
            for where, calls in (("request", own), ("background", others)):
                s = summarize(calls)
                results[name, where] = s
                print(f"| {name} | {where} | {len(s['files'])} | {len(s['stops'])} | "
                      f"{s['returns']} | {sum(s['callbacks'].values())} |")  # fmt: skip
        for (name, where), s in results.items():
            print(f"\n{name}, {where}: files: {', '.join(s['files'])}")
            if s["callbacks"]:
                cbs = ", ".join(f"{rel}:{fn} x{n}" for (rel, fn), n in s["callbacks"].items())
                print(f"{name}, {where}: call-backs: {cbs}")
            if args.list:
                print(f"{name}, {where}: stops: {' > '.join(s['stops'])}")
            if args.functions:
                for rel, fns in sorted(s["functions"].items()):
                    print(f"  {rel}: {', '.join(f'{fn} x{n}' for fn, n in fns.items())}")
        server.should_exit = True
        thread.join(10)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
