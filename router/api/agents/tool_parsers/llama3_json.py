"""Llama 3.x's JSON format: calls as JSON objects ``{"name": ..., "arguments" (or
"parameters"): {...}}`` in the text, optionally after ``<|python_tag|>``, several separated
by ``;`` (vLLM's ``llama3_json`` parser).

As vLLM reads it: every ``{`` outside an object already read must begin a JSON object
naming a function with its arguments, or the whole output is content with no calls; when
calls are found the content is None (text around them is dropped). An object that begins
exactly where the previous one ended is skipped, as vLLM skips it.
"""

from __future__ import annotations

from .base import Extracted, ParsedCall, ToolParser, dumps, raw_decode

BOT = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = (BOT, "{")

    def extract(self, text: str) -> Extracted:
        if BOT not in text and "{" not in text:
            return Extracted(text)
        calls = []
        end = -1
        at = text.find("{")
        while at >= 0:
            if at > end:
                try:
                    obj, end = raw_decode(text, at)
                except ValueError:
                    return Extracted(text)
                assert isinstance(obj, dict)  # it began with "{"
                args_key = "arguments" if "arguments" in obj else "parameters"
                if not isinstance(obj.get("name"), str) or args_key not in obj:
                    return Extracted(text)
                calls.append(ParsedCall(obj["name"], dumps(obj[args_key])))
            at = text.find("{", at + 1)
        return Extracted(None, calls) if calls else Extracted(text)
