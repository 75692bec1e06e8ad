"""Structured outputs: a request's tokens held to a JSON schema, a regex, a choice or a
grammar, with xgrammar (the backend vLLM and SGLang default to).

Why a matcher per request and a mask per step: the grammar is compiled once against this
replica's tokenizer (xgrammar caches compiled grammars by their text); each request gets its
own matcher, which knows where in the grammar its output stands. Before a step samples, each
constrained row's logits lose every token the grammar forbids next (a bitmask, filled by the
matcher); after it, the matcher accepts the sampled token. A request resumed on this replica
(a failover) replays its earlier tokens into a fresh matcher, so it goes on where it was.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvroute.events.replica_api import JSON_OBJECT_SCHEMA, StructuredOutputs

if TYPE_CHECKING:  # the engine of a cost-model replica imports no torch
    import torch

_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


class StructuredOutputCompiler:
    """Compiles a request's constraint for one tokenizer (lazily: xgrammar loads on first use)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        """``stop_token_ids``: every token that ends a request by itself (EOS and the extra
        ones of ``generation_config.json``). A grammar allows them only where it is complete;
        otherwise one whose text fits (``<|im_end|>`` inside a JSON string) could be sampled
        mid-output and end the request there."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width (the LM head's rows)
        self.stop_token_ids = list(stop_token_ids)
        self._compiler: Any = None

    def _xgr(self) -> Any:
        try:
            import xgrammar as xgr
        except ImportError:  # an optional extra: the request's 400 says what to install
            why = "structured_outputs need xgrammar on the replicas"
            raise ValueError(f"{why}: pip install 'kvroute[structured]'") from None

        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return xgr

    def matcher(self, so: StructuredOutputs, prior: Sequence[int] = ()) -> Any:
        """A matcher for ``so`` past the ``prior`` tokens (a resumed request's). Raises
        ValueError for a constraint that does not compile (the request's fault: a 4xx)."""
        xgr = self._xgr()
        c = self._compiler
        whitespace = not so.disable_any_whitespace
        try:
            if so.json is not None:
                compiled = c.compile_json_schema(so.json, any_whitespace=whitespace)
            elif so.json_object:  # an object, as OpenAI's JSON mode (not any JSON value)
                compiled = c.compile_json_schema(JSON_OBJECT_SCHEMA, any_whitespace=whitespace)
            elif so.regex is not None:
                compiled = c.compile_regex(so.regex)
            elif so.choice is not None:
                alternatives = " | ".join(json.dumps(x) for x in so.choice)
                compiled = c.compile_grammar(f"root ::= {alternatives}")
            else:
                compiled = c.compile_grammar(so.grammar)
        except Exception as exc:  # xgrammar's parse errors are RuntimeErrors
            raise ValueError(f"structured_outputs: {_message(exc)}") from None
        m = xgr.GrammarMatcher(compiled)
        for t in prior:
            if not m.accept_token(t):
                raise ValueError("structured_outputs: the resumed output breaks its constraint")
        return m


def _message(exc: Exception) -> str:
    """xgrammar's error without its log prefix (``[time] file.cc:line: ``), one line."""
    line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return _LOG_PREFIX.sub("", line)[:200]


def mask_logits(logits: torch.Tensor, rows: list[int], matchers: list[Any]) -> None:
    """Sets to -inf, in place, every token each matcher forbids next on its row (xgrammar's
    kernel, on the logits' device; the bitmask has a row per logits row, as vLLM's)."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[-1])
    for row, m in zip(rows, matchers, strict=True):
        m.fill_next_token_bitmask(bitmask, row)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
