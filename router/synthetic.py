"""Built-in workload generators for the simulator: the prefix-sharing shapes routers meet.

Each returns :class:`~kvroute.router.workloads.RequestSpec` in arrival order, fully
determined by ``seed``. Segment ids are drawn from one counter per call, so equal ids mean
genuinely shared tokens and nothing else does. Sizes follow common public descriptions of
these workloads (system prompts of 1-8k tokens, RAG chunks of ~1k, agent contexts of tens
of thousands); rates are per second and default to a load that keeps 8 ``h100-8b``
replicas busy but not saturated under round robin; ``--speed`` scales them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .workloads import RequestSpec


class _Ids:
    def __init__(self) -> None:
        self.n = 1 << 40  # far from Mooncake's ids, should anyone mix them

    def __call__(self) -> int:
        self.n += 1
        return self.n


def _zipf_weights(n: int, s: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1) ** s
    return w / w.sum()


def _poisson_times(rng: np.random.Generator, n: int, rate: float) -> np.ndarray:
    return np.cumsum(rng.exponential(1.0 / rate, size=n))


def tenants(n: int = 4000, rate: float = 12.0, seed: int = 0) -> list[RequestSpec]:
    """Many tenants (zipf popularity), each with its own cache salt and a long system prompt;
    tenants of one app template share the prompt text but, salted, never its cache."""
    rng, ids = np.random.default_rng(seed), _Ids()
    n_tenants, n_templates = 200, 40
    templates = [(ids(), int(rng.integers(1024, 8192))) for _ in range(n_templates)]
    owner = rng.integers(0, n_templates, size=n_tenants)
    pick = rng.choice(n_tenants, size=n, p=_zipf_weights(n_tenants, 1.1))
    out = []
    for t, tenant in zip(_poisson_times(rng, n, rate), pick, strict=True):
        sys_prompt = templates[owner[tenant]]
        user = (ids(), int(rng.integers(64, 1024)))
        out_len = int(rng.integers(32, 512))
        out.append(RequestSpec(float(t), (sys_prompt, user), out_len, f"tenant-{tenant}"))
    return out


def chat(n: int = 4000, rate: float = 8.0, seed: int = 0) -> list[RequestSpec]:
    """Multi-turn chats: each turn resends the whole history (system prompt, earlier turns and
    answers) plus a new message; users think ~30 s between turns."""
    rng, ids = np.random.default_rng(seed), _Ids()
    systems = [(ids(), int(rng.integers(512, 2048))) for _ in range(8)]
    out: list[RequestSpec] = []
    t = 0.0
    while len(out) < n:
        t += rng.exponential(6.0 / rate)  # conversations start; ~6 turns each
        history = [systems[int(rng.integers(0, len(systems)))]]
        at = t
        for _ in range(int(rng.geometric(1 / 6))):
            history.append((ids(), int(rng.integers(32, 512))))
            out_len = int(rng.integers(64, 768))
            out.append(RequestSpec(at, tuple(history), out_len))
            history.append((ids(), out_len))  # the answer, resent next turn
            at += 10.0 + rng.exponential(30.0)
    out.sort(key=lambda s: s.arrival_s)
    return out[:n]


def rag(n: int = 4000, rate: float = 10.0, seed: int = 0) -> list[RequestSpec]:
    """RAG: a shared instruction prompt, then 4 retrieved chunks (zipf-popular, in rank
    order) from a pool of 3,000, then the question. Prefixes share the instruction and, for
    popular chunks, the first one or two retrieved."""
    rng, ids = np.random.default_rng(seed), _Ids()
    instruction = (ids(), 768)
    docs = [(ids(), int(rng.integers(600, 1600))) for _ in range(3000)]
    w = _zipf_weights(len(docs), 1.2)
    out = []
    for t in _poisson_times(rng, n, rate):
        chosen = rng.choice(len(docs), size=4, replace=False, p=w)
        segs = (instruction, *(docs[i] for i in chosen), (ids(), int(rng.integers(16, 128))))
        out.append(RequestSpec(float(t), segs, int(rng.integers(64, 384))))
    return out


def agents(n: int = 4000, rate: float = 6.0, seed: int = 0) -> list[RequestSpec]:
    """Agent trees: a task's long context (shared tool definitions + task) forks into 8
    parallel branches within a second; each branch runs 2 more tool-call turns."""
    rng, ids = np.random.default_rng(seed), _Ids()
    tools = (ids(), 3072)
    out: list[RequestSpec] = []
    t = 0.0
    while len(out) < n:
        t += rng.exponential(24.0 / rate)  # 24 requests per task
        root = (tools, (ids(), int(rng.integers(2048, 16384))))
        for _ in range(8):
            at = t + rng.uniform(0.0, 1.0)
            ctx = (*root, (ids(), int(rng.integers(128, 1024))))
            for _turn in range(3):
                out_len = int(rng.integers(64, 512))
                out.append(RequestSpec(at, ctx, out_len))
                ctx = (*ctx, (ids(), out_len), (ids(), int(rng.integers(256, 2048))))
                at += 2.0 + rng.exponential(5.0)
    out.sort(key=lambda s: s.arrival_s)
    return out[:n]


WORKLOADS: dict[str, Callable[..., list[RequestSpec]]] = {
    "tenants": tenants,
    "chat": chat,
    "rag": rag,
    "agents": agents,
}


def make_workload(name: str, n: int, seed: int = 0, speed: float = 1.0) -> list[RequestSpec]:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    if speed <= 0:
        raise ValueError("speed must be > 0")
    specs = WORKLOADS[name](n=n, seed=seed)
    if speed == 1.0:
        return specs
    return [
        RequestSpec(s.arrival_s / speed, s.segments, s.output_length, s.cache_salt) for s in specs
    ]
