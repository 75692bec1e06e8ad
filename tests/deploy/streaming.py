"""Streams read as a client reads them, and a front door's metrics: for the tests that
change a fleet under load (``kvroute scale``, autoscaling)."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field

import httpx

from ..prom import scrape, value


def metric(c: httpx.Client, name: str, **labels: str) -> float:
    """This front door's ``name`` (0 when it has none)."""
    return value(scrape(str(c.base_url).rstrip("/")), name, **labels) or 0.0


@dataclass
class Stream:
    prompt: str
    replica: str = ""
    tokens: int = 0  # generated, from the final usage chunk
    chunks: int = 0  # received so far (progress; a chunk holds a step's tokens)
    finish: str | None = None
    error: str | None = None
    started: threading.Event = field(default_factory=threading.Event)
    t0: float = 0.0  # when it was sent (time.monotonic)


def read_stream(url: str, s: Stream, max_tokens: int) -> None:
    body = {"model": "tiny", "prompt": s.prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
            s.replica = r.headers.get("x-kvroute-replica", "")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    s.error = str(chunk["error"])
                    continue
                s.started.set()
                if chunk.get("usage"):  # the last chunk: the tokens generated, all told
                    s.tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):  # one chunk may carry several tokens (one step's)
                    s.chunks += 1
                    s.finish = chunk["choices"][0]["finish_reason"] or s.finish
    except Exception as exc:  # the test reports it
        s.error = repr(exc)
    finally:
        s.started.set()
