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
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from kvroute.events.replica_api import JSON_OBJECT_SCHEMA, StructuredOutputs

if TYPE_CHECKING:  # the engine of a cost-model replica imports no torch
    import torch

_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


# Compiled grammars (or their refusals) kept per engine (xgrammar's own cache, bounded too,
# holds their parts)
CACHED_GRAMMARS = 256
XGRAMMAR_CACHE_BYTES = 512 << 20  # vLLM's default (VLLM_XGRAMMAR_CACHE_MB)
COMPACT_SEPARATORS = (",", ":")  # JSON with no whitespace at all (vLLM's, for the same flag)


class StructuredOutputCompiler:
    """Compiles a request's constraint for one tokenizer (lazily: xgrammar loads on first
    use). Thread-safe: :class:`~.async_engine.AsyncLLMEngine` compiles a new constraint on a
    worker thread before the request reaches the engine thread, so a slow compilation (a
    big schema on a 128k vocabulary) never stalls the other requests' steps; the engine
    thread then finds it compiled."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        """``stop_token_ids``: every token that ends a request by itself (EOS and the extra
        ones of ``generation_config.json``). A grammar allows them only where it is complete;
        otherwise one whose text fits (``<|im_end|>`` inside a JSON string) could be sampled
        mid-output and end the request there."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width (the LM head's rows)
        self.stop_token_ids = list(stop_token_ids) or None  # None: xgrammar's own guess
        self._compiler: Any = None
        self._compiled: OrderedDict[bytes, Any] = OrderedDict()
        self._lock = threading.Lock()

    def _xgr(self) -> Any:
        try:
            import xgrammar as xgr
        except ImportError:  # an optional extra: the request's 400 says what to install
            why = "structured_outputs need xgrammar on the replicas"
            raise ValueError(f"{why}: pip install 'kvroute[structured]'") from None
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
                self._compiler = xgr.GrammarCompiler(
                    info, max_threads=1, cache_limit_bytes=XGRAMMAR_CACHE_BYTES
                )
        return xgr

    def is_compiled(self, so: StructuredOutputs) -> bool:
        with self._lock:
            return msgspec.msgpack.encode(so) in self._compiled

    def compile(self, so: StructuredOutputs) -> Any:
        """``so``'s compiled grammar (cached). Raises ValueError for a constraint that does
        not compile (the request's fault: a 4xx)."""
        key = msgspec.msgpack.encode(so)
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
        if isinstance(compiled, ValueError):  # refused before: not compiled again
            raise compiled
        if compiled is not None:
            return compiled
        self._xgr()
        c = self._compiler
        compact = {"any_whitespace": False, "separators": COMPACT_SEPARATORS}
        whitespace = compact if so.disable_any_whitespace else {}
        try:
            if so.json is not None:
                compiled = c.compile_json_schema(so.json, **whitespace)
            elif so.json_object:  # an object, as OpenAI's JSON mode (vLLM's too)
                compiled = c.compile_json_schema(JSON_OBJECT_SCHEMA, **whitespace)
            elif so.regex is not None:
                compiled = c.compile_regex(so.regex)
            elif so.choice is not None:  # EBNF string literals: JSON's escapes, not ASCII's
                alternatives = " | ".join(json.dumps(x, ensure_ascii=False) for x in so.choice)
                compiled = c.compile_grammar(f"root ::= {alternatives}")
            else:
                compiled = c.compile_grammar(so.grammar)
        except Exception as exc:  # xgrammar's parse errors are RuntimeErrors
            compiled = ValueError(f"structured_outputs: {_message(exc)}")
        with self._lock:  # a refusal is kept too: the engine thread gets it without compiling
            self._compiled[key] = compiled
            while len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        if isinstance(compiled, ValueError):
            raise compiled
        return compiled

    def matcher(self, so: StructuredOutputs, prior: Sequence[int] = ()) -> Any:
        """A matcher for ``so`` past the ``prior`` tokens (a resumed request's). Raises
        ValueError for a constraint that does not compile (the request's fault: a 4xx)."""
        compiled = self.compile(so)
        xgr = self._xgr()
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
