"""Kernel backends: one small class per platform, chosen once when a model runner is built
(as vLLM's attention backends), so that no step reads the environment to find its kernels.

:func:`select_backend` is the one place that reads the three switches:

- ``KVROUTE_KERNELS_BACKEND``: ``torch`` forces the reference everywhere (to bisect a kernel
  bug); ``triton`` makes a missing Triton on CUDA an error instead of a silent fallback to
  the reference; unset (or empty) chooses by device.
- ``KVROUTE_CPU_DECODE_KERNEL=0``: CPU decodes through the torch reference, not the C kernel.
- ``KVROUTE_CPU_PREFILL_KERNEL=0``: CPU prefills through torch's SDPA, not the C kernel.

Every backend offers the kernels' contract: ``store_kv``, and ``paged_attention`` with
:func:`kvroute.kernels.reference.paged_attention`'s signature (the step's
:class:`~kvroute.kernels.metadata.AttentionMetadata`, what each layer passes).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from types import ModuleType

import torch
from torch import Tensor

from kvroute.kernels import cpu, reference

__all__ = [
    "BACKEND_ENV",
    "CPU_DECODE_ENV",
    "CPU_PREFILL_ENV",
    "CpuBackend",
    "KernelBackend",
    "TorchBackend",
    "TritonBackend",
    "select_backend",
]

BACKEND_ENV = "KVROUTE_KERNELS_BACKEND"
CPU_DECODE_ENV = "KVROUTE_CPU_DECODE_KERNEL"
CPU_PREFILL_ENV = "KVROUTE_CPU_PREFILL_KERNEL"
_CHOICES = ("", "torch", "triton")

_triton_error: list[BaseException] = []  # why Triton is unusable, for the error message


@functools.cache
def _triton_module() -> ModuleType | None:
    """The Triton kernels module, or None where CUDA or Triton is missing or broken.

    Triton is imported lazily and only when CUDA is available: importing it (and its
    autotuner) on a machine without a GPU can fail."""
    if not torch.cuda.is_available():
        return None
    try:
        from kvroute.kernels import triton_kernels
    except Exception as exc:  # not only ImportError: a broken install can raise anything
        _triton_error.append(exc)
        return None
    return triton_kernels


class KernelBackend:
    """``store_kv`` and ``paged_attention`` of one platform, bound once."""

    name = "abstract"
    store_kv: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], None]
    # (query, k_cache, v_cache, meta, *, scale, sliding_window): the reference's signature
    paged_attention: Callable[..., Tensor]

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class TorchBackend(KernelBackend):
    """The plain-torch reference: the definition, any device, any dtype."""

    name = "torch"
    store_kv = staticmethod(reference.store_kv)
    paged_attention = staticmethod(reference.paged_attention)


class CpuBackend(KernelBackend):
    """The reference with decodes and prefills through the C kernels, each where it is built
    and not switched off (the tensors that do not fit a kernel still take the reference)."""

    name = "cpu"
    store_kv = staticmethod(cpu.store_kv)

    def __init__(self, *, decode_kernel: bool = True, prefill_kernel: bool = True) -> None:
        self.decode_kernel = decode_kernel and cpu.decode_kernel_available()
        self.prefill_kernel = prefill_kernel and cpu.prefill_kernel_available()
        self.paged_attention = functools.partial(  # type: ignore[method-assign]
            cpu.paged_attention,
            decode_kernel=self.decode_kernel,
            prefill_kernel=self.prefill_kernel,
        )

    def __repr__(self) -> str:
        return (
            f"CpuBackend(decode_kernel={self.decode_kernel}, prefill_kernel={self.prefill_kernel})"
        )


class TritonBackend(KernelBackend):
    """The Triton kernels (CUDA)."""

    name = "triton"

    def __init__(self, module: ModuleType | None = None) -> None:
        module = module or _triton_module()
        if module is None:
            why = f": {_triton_error[0]!r}" if _triton_error else ""
            raise RuntimeError(f"Triton is not usable{why}")
        self.module = module
        self.store_kv = module.store_kv  # type: ignore[method-assign]
        self.paged_attention = module.paged_attention  # type: ignore[method-assign]


def select_backend(
    device: torch.device | str, environ: Mapping[str, str] | None = None
) -> KernelBackend:
    """The backend for tensors on ``device``, from the switches in ``environ`` (default
    ``os.environ``), read here and nowhere else: CUDA takes Triton where it imports (else
    the reference, or an error under ``KVROUTE_KERNELS_BACKEND=triton``), the CPU the C
    kernels, any other device the reference."""
    env = os.environ if environ is None else environ
    device = torch.device(device)
    choice = env.get(BACKEND_ENV, "").strip().lower()
    if choice not in _CHOICES:
        raise ValueError(f"{BACKEND_ENV} must be torch, triton or unset, got {choice!r}")
    if choice == "torch":
        return TorchBackend()
    if device.type == "cuda":
        mod = _triton_module()
        if mod is None:
            if choice == "triton":
                why = f": {_triton_error[0]!r}" if _triton_error else ""
                raise RuntimeError(f"{BACKEND_ENV}=triton but Triton is not usable{why}")
            return TorchBackend()
        return TritonBackend(mod)
    if device.type == "cpu":
        return CpuBackend(
            decode_kernel=env.get(CPU_DECODE_ENV, "1") != "0",
            prefill_kernel=env.get(CPU_PREFILL_ENV, "1") != "0",
        )
    return TorchBackend()
