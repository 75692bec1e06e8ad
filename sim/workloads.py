"""Built-in workload generators for the simulator: the prefix-sharing shapes routers meet.

Each returns :class:`RequestSpec` in arrival order, fully
determined by ``seed``. Segment ids are drawn from one counter per call, so equal ids mean
genuinely shared tokens and nothing else does. Sizes follow common public descriptions of
these workloads (system prompts of 1-8k tokens, RAG chunks of ~1k, agent contexts of tens
of thousands); rates are per second and default to a load that keeps 8 ``h100-8b``
replicas busy but not saturated under round robin; ``--speed`` scales them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

SEGMENT_TOKENS = 512  # tokens generated per segment id at least (Mooncake's block)
DEFAULT_VOCAB = 128_256  # Llama 3's vocabulary: token ids fit in uint32


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of a workload: its prompt as segments whose tokens are fixed by their id.

    Two prompts that start with the same segments (same ids, same lengths) share a genuine
    token prefix. ``cache_salt`` isolates a tenant, as in vLLM's API.
    """

    arrival_s: float
    segments: tuple[tuple[int, int], ...]  # (segment id, tokens)
    output_length: int
    cache_salt: str | None = None
    lora_name: str | None = None  # its LoRA adapter (None: the base model)

    @property
    def input_length(self) -> int:
        return sum(n for _, n in self.segments)


class TokenSource:
    """Segment id -> its fixed uint32 tokens, generated once and kept (little-endian bytes).

    A segment's tokens are ``block_tokens(id, vocab, n)``: a PCG64 stream seeded by the id,
    whose first k values do not depend on n, so a short (cut) segment is a prefix of the
    full one.
    """

    def __init__(self, vocab_size: int = DEFAULT_VOCAB) -> None:
        self.vocab_size = vocab_size
        self._cache: dict[int, bytes] = {}

    def segment(self, seg_id: int, n: int) -> bytes:
        raw = self._cache.get(seg_id)
        if raw is None or len(raw) < 4 * n:
            gen = np.random.Generator(np.random.PCG64(seg_id))
            size = max(n, SEGMENT_TOKENS)
            raw = gen.integers(0, self.vocab_size, size=size, dtype=np.int64)
            raw = self._cache[seg_id] = raw.astype("<u4").tobytes()
        return raw if len(raw) == 4 * n else raw[: 4 * n]

    def prompt_bytes(self, spec: RequestSpec) -> bytes:
        return b"".join([self.segment(s, n) for s, n in spec.segments])

    def __len__(self) -> int:
        return len(self._cache)


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


def lora(
    n: int = 4000, rate: float = 12.0, seed: int = 0, adapters: int = 64, zipf_s: float = 1.0
) -> list[RequestSpec]:
    """Per-tenant LoRA adapters: ``adapters`` tenants, each with its own adapter and its own
    system prompt (1-4k tokens; salted per tenant), Zipf-popular (exponent ``zipf_s``);
    each request is the tenant's system prompt, a user message and an answer, as
    ``tenants``. The adapter workload of issue 37: slots, loads and prefixes all matter."""
    rng, ids = np.random.default_rng(seed), _Ids()
    systems = [(ids(), int(rng.integers(1024, 4096))) for _ in range(adapters)]
    pick = rng.choice(adapters, size=n, p=_zipf_weights(adapters, zipf_s))
    out = []
    for t, k in zip(_poisson_times(rng, n, rate), pick, strict=True):
        user = (ids(), int(rng.integers(64, 1024)))
        out_len = int(rng.integers(32, 512))
        out.append(RequestSpec(float(t), (systems[k], user), out_len, f"tenant-{k}", f"lora-{k}"))
    return out


def _owner(spec: RequestSpec) -> tuple[object, ...]:
    """Whose request it is: its tenant (salt), else its first two segments, which name a
    conversation (chat), a task (agents) or the first document retrieved (rag)."""
    return (spec.cache_salt,) if spec.cache_salt else tuple(s for s, _ in spec.segments[:2])


def assign_adapters(
    specs: Sequence[RequestSpec], adapters: int, zipf_s: float = 1.0, seed: int = 0
) -> list[RequestSpec]:
    """The workload with an adapter per tenant (:func:`_owner`): each owner, in order of
    first arrival, draws one of ``adapters`` adapters, Zipf-popular (exponent ``zipf_s``),
    seeded; every request of an owner uses its adapter."""
    if adapters < 1:
        raise ValueError("adapters must be >= 1")
    rng = np.random.default_rng([seed, 37])
    weights = _zipf_weights(adapters, zipf_s)
    chosen: dict[tuple[object, ...], str] = {}
    out = []
    for spec in specs:
        key = _owner(spec)
        name = chosen.get(key)
        if name is None:
            name = chosen[key] = f"lora-{int(rng.choice(adapters, p=weights))}"
        out.append(dataclasses.replace(spec, lora_name=name))
    return out


WORKLOADS: dict[str, Callable[..., list[RequestSpec]]] = {
    "tenants": tenants,
    "chat": chat,
    "rag": rag,
    "agents": agents,
    "lora": lora,
}


def make_workload(
    name: str,
    n: int,
    seed: int = 0,
    speed: float = 1.0,
    adapters: int | None = None,
    adapter_zipf: float = 1.0,
) -> list[RequestSpec]:
    """A built-in workload; ``adapters``: with that many LoRA adapters, Zipf-popular by
    ``adapter_zipf`` (the ``lora`` workload's own; another's assigned per tenant)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    if speed <= 0:
        raise ValueError("speed must be > 0")
    if name == "lora":
        specs = lora(n=n, seed=seed, adapters=adapters or 64, zipf_s=adapter_zipf)
    else:
        specs = WORKLOADS[name](n=n, seed=seed)
        if adapters:
            specs = assign_adapters(specs, adapters, adapter_zipf, seed)
    if speed == 1.0:
        return specs
    return [dataclasses.replace(s, arrival_s=s.arrival_s / speed) for s in specs]
