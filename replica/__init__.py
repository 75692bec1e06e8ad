"""One engine per accelerator: block pool, scheduler, model runner, sampling, Ray actor.

Offline use mirrors vLLM: ``LLM(model="tiny").generate(prompts, SamplingParams(...))``;
online use is :class:`AsyncLLMEngine`, which streams per-request outputs.
"""

from .async_engine import AsyncLLMEngine, EngineDeadError
from .engine import EngineConfig, LLMEngine
from .llm import LLM
from .models import BUILTIN_MODELS, resolve_model, tiny_model_path
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams

__all__ = [
    "BUILTIN_MODELS",
    "LLM",
    "AsyncLLMEngine",
    "CompletionOutput",
    "EngineConfig",
    "EngineDeadError",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "resolve_model",
    "tiny_model_path",
]
