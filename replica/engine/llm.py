"""Offline batch inference, shaped like vLLM's ``LLM``: give prompts, get outputs in order."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence
from typing import Any

from kvroute.events.replica_api import SamplingParams

from ..core.outputs import RequestOutput
from .llm_engine import EngineConfig, LLMEngine

# One prompt: text, token ids, or a dict {"prompt" | "prompt_token_ids": ..., "cache_salt": ...,
# "lora_name": ...} (lora_name: a registered LoRA adapter, see EngineConfig.lora_modules)
PromptType = str | Sequence[int] | dict[str, Any]


class LLM:
    """``LLM(model="tiny" | "smollm2-135m" | PATH, **EngineConfig fields)``."""

    def __init__(self, model: str = "tiny", **kwargs: Any) -> None:
        kwargs.setdefault("stream_text", False)  # offline: decode once per request
        self.llm_engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in the prompts' order.
        ``priority``: one per prompt, lower runs first (vLLM's ``LLM.generate``)."""
        batch = _as_batch(prompts)
        if priority is not None and len(priority) != len(batch):
            raise ValueError(f"{len(priority)} priorities for {len(batch)} prompts")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(batch)
        else:
            params = list(sampling_params)
            if len(params) != len(batch):
                raise ValueError(f"{len(params)} sampling params for {len(batch)} prompts")
        engine = self.llm_engine
        order: dict[str, int] = {}
        try:
            for i, (prompt, p) in enumerate(zip(batch, params, strict=True)):
                rid = str(next(self._ids))
                if isinstance(prompt, dict):
                    body = prompt.get("prompt_token_ids", prompt.get("prompt"))
                    if body is None:
                        raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
                    engine.add_request(
                        rid,
                        body,
                        p,
                        cache_salt=prompt.get("cache_salt"),
                        lora_name=prompt.get("lora_name"),
                        priority=priority[i] if priority is not None else 0,
                    )
                else:
                    engine.add_request(
                        rid, prompt, p, priority=priority[i] if priority is not None else 0
                    )
                order[rid] = i
        except Exception:
            engine.abort_requests(list(order))
            raise
        results: list[RequestOutput | None] = [None] * len(batch)
        done = 0
        while done < len(batch):
            for out in engine.step():
                if out.finished and out.request_id in order:
                    results[order[out.request_id]] = out
                    done += 1
                    if use_tqdm:
                        print(f"\rgenerate: {done}/{len(batch)}", end="", file=sys.stderr)
        if use_tqdm:
            print(file=sys.stderr)
        return [r for r in results if r is not None]

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Renders each conversation with the model's chat template, then generates."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.llm_engine.apply_chat_template(list(c)) for c in convs]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params)

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()


def _as_batch(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    seq = list(prompts)
    if seq and all(isinstance(t, int) for t in seq):
        return [seq]  # one prompt given as token ids
    return seq
