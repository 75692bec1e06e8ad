"""Hermes' and Qwen2/2.5/3's format: each call a JSON object ``{"name": ..., "arguments":
{...}}`` between ``<tool_call>`` and ``</tool_call>`` (vLLM's ``hermes`` parser).

As vLLM reads it: a call cut off before its closing tag still counts when its JSON is
whole; one call that does not parse (bad JSON, no ``name`` or ``arguments``) makes the
whole output content, with no calls; the content is the text before the first call (text
between and after calls is dropped).
"""

from __future__ import annotations

import json

from .base import Extracted, ParsedCall, ToolParser, dumps

START, END = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"
    markers = (START,)

    def extract(self, text: str) -> Extracted:
        first = text.find(START)
        if first < 0:
            return Extracted(text)
        calls = []
        at = first
        while at >= 0:
            body_at = at + len(START)
            end = text.find(END, body_at)
            body = text[body_at:] if end < 0 else text[body_at:end]
            call = _call(body)
            if call is None:
                return Extracted(text)
            calls.append(call)
            at = -1 if end < 0 else text.find(START, end + len(END))
        return Extracted(text[:first] or None, calls)


def _call(body: str) -> ParsedCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if "arguments" not in obj:
        return None
    return ParsedCall(obj["name"], dumps(obj["arguments"]))
