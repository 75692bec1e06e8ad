"""Tool-call parsers by vLLM's names (``--tool-call-parser``); see :mod:`.base`."""

from __future__ import annotations

from typing import Any

from .base import CallStream, Extracted, ParsedCall, ToolParser
from .hermes import HermesParser
from .llama3_json import Llama3JsonParser
from .mistral import MistralParser

__all__ = ["PARSERS", "CallStream", "Extracted", "ParsedCall", "ToolParser", "make_parser"]

# vLLM's names; Qwen2.5/3 models are served with ``hermes`` in vLLM's docs too.
PARSERS = ("hermes", "llama3_json", "mistral")


def make_parser(name: str, tokenizer: Any = None) -> ToolParser:
    """The parser named ``name`` for the served model's ``tokenizer`` (Mistral's format
    depends on it); ValueError for a name not served here."""
    if name == "hermes":
        return HermesParser()
    if name == "llama3_json":
        return Llama3JsonParser()
    if name == "mistral":
        vocab = tokenizer.get_vocab() if tokenizer is not None else None
        return MistralParser.for_vocab(vocab)
    raise ValueError(f"unknown tool-call parser {name!r}: one of {', '.join(PARSERS)}")
