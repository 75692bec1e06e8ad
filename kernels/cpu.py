"""The CPU path: the torch reference, with decodes and prefills through C kernels that read
the paged cache in place (``kernels/cpu_attention.c``, ``kernels/cpu_prefill.c``) where
they are built and the tensors fit them.

Why a separate module: the reference stays the definition (any dtype, any strides, fp64 in
tests), while the serving path on a CPU takes the fast kernel for the common case -- fp32
caches, contiguous rows -- and falls back to the reference for anything else.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import Tensor

from kvroute.kernels import reference
from kvroute.kernels.metadata import AttentionMetadata

__all__ = [
    "decode_kernel_available",
    "paged_attention",
    "prefill_kernel_available",
    "store_kv",
]

store_kv = reference.store_kv

try:  # optional, like kvroute.events._chain: built at install time where a C compiler exists
    from kvroute.kernels import _cpu_attention
except ImportError:  # pragma: no cover - a build without a compiler
    _cpu_attention = None

try:
    from kvroute.kernels import _cpu_prefill
except ImportError:  # pragma: no cover - a build without a compiler
    _cpu_prefill = None


def decode_kernel_available() -> bool:
    """Whether the C decode kernel is built in this install. Whether the engine uses it is
    :class:`kvroute.kernels.backends.CpuBackend`'s (``KVROUTE_CPU_DECODE_KERNEL=0``: no)."""
    return _cpu_attention is not None


def prefill_kernel_available() -> bool:
    """Whether the C prefill kernel is built (``KVROUTE_CPU_PREFILL_KERNEL=0``: unused)."""
    return _cpu_prefill is not None


def _fits(query: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor) -> bool:
    return (
        query.dtype == k_cache.dtype == v_cache.dtype == torch.float32
        and query.device.type == "cpu"
        and query.stride(2) == 1
        and query.stride(1) == query.shape[2]
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and block_tables.dtype == torch.int32
        and block_tables.stride(1) == 1
    )


@dataclass(frozen=True, slots=True)
class _Plan:
    """What every layer of one step needs from the batch's index tensors, worked out once:
    the host lists, which sequences decode (ordered so siblings of one cached prefix run
    back to back and its blocks stay in cache) and which prefill, and int32 copies for C,
    split into one run of sequences per thread (:func:`_split`)."""

    qsl: list[int]
    lens: list[int]
    decodes: list[Tensor]  # int32 sequence indices for the C kernel, one run per thread
    prefills: list[int]  # more than one new token, no window cutting them
    prefill_seqs: list[Tensor]  # the same, int32, for the C kernel, one run per thread
    windowed: list[int]  # more than one new token, some denied keys by the window
    seq_lens: Tensor  # int32, contiguous
    query_start_loc: Tensor  # int32, contiguous


# Multi-threaded engines (torch.get_num_threads() > 1): the C kernels run on runs of the
# batch's sequences at once, one per thread, as the GEMMs around them do on torch's pool.
# The kernels release the GIL and each sequence writes only its own output rows, so the
# threads share nothing; a sequence's result does not depend on the split. Below this much
# work (keys read for decodes, query-key pairs for prefills) a layer's call is too short to
# be worth handing out (a hand-off costs tens of us).
_MIN_DECODE_KEYS = 2048
_MIN_PREFILL_PAIRS = 65536
_pool: ThreadPoolExecutor | None = None
_pool_workers = 0
num_parallel_calls = 0  # calls split over threads, for tests and benchmarks


def _split(seqs: list[int], work: list[float], threads: int, least: float) -> list[Tensor]:
    """``seqs`` in contiguous runs of about equal ``work``, at most ``threads`` of them (one
    run when the total is below ``least``)."""
    total = sum(work)
    if threads <= 1 or len(seqs) < 2 or total < least:
        return [torch.tensor(seqs, dtype=torch.int32)] if seqs else []
    runs: list[list[int]] = [[]]
    done, share = 0.0, total / threads
    for s, w in zip(seqs, work, strict=True):
        if runs[-1] and done >= share * len(runs) and len(runs) < threads:
            runs.append([])
        runs[-1].append(s)
        done += w
    return [torch.tensor(r, dtype=torch.int32) for r in runs]


def _run(kernel: Callable[..., None], runs: list[Tensor], args: Callable[[Tensor], tuple]) -> None:  # type: ignore[type-arg]
    """``kernel(*args(run))`` for each run of sequences: the first on this thread, the others
    on the pool's, all at once."""
    global _pool, _pool_workers, num_parallel_calls
    if len(runs) == 1:
        kernel(*args(runs[0]))
        return
    if _pool is None or _pool_workers < len(runs) - 1:
        _pool_workers = len(runs) - 1
        _pool = ThreadPoolExecutor(_pool_workers, thread_name_prefix="kvroute-attention")
    num_parallel_calls += 1
    futures = [_pool.submit(kernel, *args(run)) for run in runs[1:]]
    kernel(*args(runs[0]))
    for f in futures:
        f.result()


_Entry = tuple[tuple["weakref.ref[Tensor]", ...], tuple[int, ...], tuple[Tensor | None, ...], _Plan]


class _StepPlans:
    """The last batch's plan, reused while the same index tensors come back unchanged.

    A step hands one set of tensors to all its layers; they are recognised by identity
    through weak references (a freed tensor never matches, so a new step whose tensors
    reuse the old addresses cannot see a stale plan) and by their in-place version counter.
    Inference tensors (``torch.inference_mode``) keep no version counter: for those a copy
    of the contents, a few hundred integers, is compared instead.
    """

    def __init__(self) -> None:
        # (weak references to the tensors, their key, copies of the unversioned ones, the
        # plan): replaced as one tuple, so engines stepping on two threads of one process
        # never pair one's plan with another's tensors
        self._last: _Entry | None = None

    def get(
        self,
        query: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
        sliding_window: int | None,
    ) -> _Plan:
        tensors = (meta.block_tables, meta.seq_lens, meta.query_start_loc)
        # Everything check_batch reads besides the tensors' contents: a hit has passed it.
        key = (
            *(-1 if t.is_inference() else t._version for t in tensors),
            *query.shape,
            *k_cache.shape,
            *v_cache.shape,
            meta.max_query_len or -1,
            meta.max_seq_len or -1,
            -1 if sliding_window is None else sliding_window,
            torch.get_num_threads(),
        )
        last = self._last
        if (
            last is not None
            and key == last[1]
            and all(r() is t for r, t in zip(last[0], tensors, strict=True))
            and all(c is None or torch.equal(c, t) for c, t in zip(last[2], tensors, strict=True))
        ):
            return last[3]
        qsl, lens = reference.check_batch(query, k_cache, v_cache, meta, sliding_window)
        threads = torch.get_num_threads()
        decodes = [i for i in range(len(lens)) if qsl[i + 1] - qsl[i] == 1]
        prefills, windowed = [], []  # more than one new token: uncut / cut by the window
        for i in range(len(lens)):
            if qsl[i + 1] - qsl[i] > 1:
                cut = reference.window_applies(lens[i], sliding_window)
                (windowed if cut else prefills).append(i)
        if len(decodes) > 1:
            first = meta.block_tables[:, 0].tolist()
            decodes.sort(key=first.__getitem__)
        pairs = [(qsl[i + 1] - qsl[i]) * (lens[i] - (qsl[i + 1] - qsl[i]) / 2) for i in prefills]
        plan = _Plan(
            qsl=qsl,
            lens=lens,
            decodes=_split(decodes, [lens[i] for i in decodes], threads, _MIN_DECODE_KEYS),
            prefills=prefills,
            prefill_seqs=_split(prefills, pairs, threads, _MIN_PREFILL_PAIRS),
            windowed=windowed,
            seq_lens=meta.seq_lens.to(torch.int32).contiguous(),
            query_start_loc=meta.query_start_loc.to(torch.int32).contiguous(),
        )
        refs = tuple(weakref.ref(t) for t in tensors)
        copies = tuple(t.clone() if t.is_inference() else None for t in tensors)
        self._last = (refs, key, copies, plan)
        return plan


_plans = _StepPlans()


def _paged_args(
    out: Tensor,
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    plan: _Plan,
    seqs: Tensor,
    scale: float,
    sliding_window: int | None,
) -> tuple[int | float, ...]:
    """The C kernels' shared arguments (``kernels/cpu_paged.h``), for the sequences ``seqs``."""
    return (
        out.data_ptr(),
        query.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        plan.seq_lens.data_ptr(),
        plan.query_start_loc.data_ptr(),
        seqs.data_ptr(),
        len(seqs),
        query.shape[1],
        k_cache.shape[2],
        query.shape[2],
        k_cache.shape[1],
        block_tables.stride(0),
        query.stride(0),
        out.stride(0),
        scale,
        sliding_window or 0,
    )


def paged_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    decode_kernel: bool = True,
    prefill_kernel: bool = True,
) -> Tensor:
    """Same contract as :func:`kvroute.kernels.reference.paged_attention`. ``decode_kernel``
    False: everything through the reference; ``prefill_kernel`` False: prefills through
    torch's SDPA (each kernel is used only where it is built)."""
    block_tables = meta.block_tables
    if not (
        decode_kernel
        and _cpu_attention is not None
        and _fits(query, k_cache, v_cache, block_tables)
    ):
        return reference.paged_attention(
            query, k_cache, v_cache, meta, scale=scale, sliding_window=sliding_window
        )
    plan = _plans.get(query, k_cache, v_cache, meta, sliding_window)
    out = torch.empty(query.shape, dtype=query.dtype)
    out[plan.qsl[-1] :].zero_()
    torch_prefills = plan.windowed
    if plan.prefills and prefill_kernel and _cpu_prefill is not None and query.shape[2] % 16 == 0:
        _run(
            _cpu_prefill.prefill,
            plan.prefill_seqs,
            lambda seqs: _paged_args(
                out, query, k_cache, v_cache, block_tables, plan, seqs, scale, None
            ),
        )
    else:
        torch_prefills = plan.prefills + plan.windowed
    if torch_prefills:  # the reference's SDPA paths
        reference.attend_prefills(
            out,
            query,
            k_cache,
            v_cache,
            block_tables,
            plan.qsl,
            plan.lens,
            scale,
            sliding_window,
            torch_prefills,
        )
    if plan.decodes:  # windowed or not: the kernel starts each walk at the window's edge
        assert _cpu_attention is not None
        _run(
            _cpu_attention.decode,
            plan.decodes,
            lambda seqs: _paged_args(
                out, query, k_cache, v_cache, block_tables, plan, seqs, scale, sliding_window
            ),
        )
    return out
