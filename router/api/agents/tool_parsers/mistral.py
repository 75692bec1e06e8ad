"""Mistral's format: ``[TOOL_CALLS]`` then the calls (vLLM's ``mistral`` parser).

Two generations, told apart as vLLM tells them, by whether the tokenizer knows ``[ARGS]``:
- before v11 (Mistral 7B v0.3 and its kin): ``[TOOL_CALLS][{"name": ..., "arguments":
  {...}}, ...]``, one JSON array (or object); entries that are not calls are skipped, a
  missing name is ``""``, arguments given as text are kept as they are. When nothing
  parses, the content is the text after the marker.
- v11 and later: ``[TOOL_CALLS]name[ARGS]{...}`` (or ``name{...}``) per call; the
  arguments are the first JSON value after the name, text after it dropped.
The content is the text before the first marker (None when blank).
"""

from __future__ import annotations

import json
import re

from .base import Extracted, ParsedCall, ToolParser, dumps, raw_decode

BOT, ARGS = "[TOOL_CALLS]", "[ARGS]"
_ARRAY = re.compile(r"\[{.*}\]", re.DOTALL)


class MistralParser(ToolParser):
    name = "mistral"
    markers = (BOT,)

    def __init__(self, v11: bool = False) -> None:
        self.v11 = v11

    @classmethod
    def for_vocab(cls, vocab: dict[str, int] | None) -> MistralParser:
        return cls(v11=bool(vocab) and ARGS in vocab)  # type: ignore[operator]

    def extract(self, text: str) -> Extracted:
        if BOT not in text:
            return Extracted(text)
        content, *segments = text.split(BOT)
        head = content if content.strip() else None
        if self.v11:
            calls = [c for c in (_v11_call(s) for s in segments) if c is not None]
            return Extracted(head, calls) if calls else Extracted(text)
        body = next((s.strip() for s in segments if s.strip()), "")
        calls = _array_calls(_first_json(body))
        return Extracted(head, calls) if calls else Extracted(body)


def _first_json(body: str) -> object:
    try:
        return raw_decode(body)[0]
    except ValueError:
        pass
    found = _ARRAY.findall(body)
    try:
        return json.loads(found[0]) if found else None
    except ValueError:
        return None


def _array_calls(parsed: object) -> list[ParsedCall]:
    items = [parsed] if isinstance(parsed, dict) else parsed
    if not isinstance(items, list):
        return []
    calls = []
    for item in items:
        if not isinstance(item, dict) or ("name" not in item and "arguments" not in item):
            continue
        name = item.get("name")
        args = item.get("arguments")
        text = "{}" if args is None else args if isinstance(args, str) else dumps(args)
        calls.append(ParsedCall(name if isinstance(name, str) else "", text))
    return calls


def _v11_call(segment: str) -> ParsedCall | None:
    if ARGS in segment:
        name, _, args = segment.partition(ARGS)
    elif "{" in segment:
        at = segment.index("{")
        name, args = segment[:at], segment[at:]
    else:
        return None
    args = args.strip()
    if not args:
        return ParsedCall(name.strip(), "{}")
    try:
        end = raw_decode(args)[1]
    except ValueError:
        return ParsedCall(name.strip(), args)
    return ParsedCall(name.strip(), args[:end])
