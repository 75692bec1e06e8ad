"""What a tool-call parser reads from a model's text: calls, and the text that is content.

Why a parser per model family: each family writes its calls in its own way (Qwen's and
Hermes' ``<tool_call>`` JSON, Llama 3's bare JSON, Mistral's ``[TOOL_CALLS]``), and vLLM
names the parser on the command line (``--tool-call-parser``), so a client moving between
vLLM and kvroute gets the same calls from the same text: the parsers here follow vLLM's
(``tests/router/api/agents/test_tool_parser_corpus.py`` compares them on a corpus).

Streaming (:class:`CallStream`): content is sent as it comes, up to where a call may
start; the calls themselves are parsed once the output is whole, by the same
:meth:`ToolParser.extract` as a whole answer. So a stream's calls always equal the whole
answer's -- a call that turns out malformed is never half sent -- at the price of calls
arriving when the output ends rather than piece by piece. The content is the whole
answer's too, but where vLLM's whole answer drops text a stream has already sent: the text
before a Llama 3 call, and before a Mistral marker whose calls do not parse.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

_decoder = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """One call: the function's name and its arguments as JSON text (OpenAI's shape)."""

    name: str
    arguments: str


@dataclass(slots=True)
class Extracted:
    """A whole output read: ``content`` (None: nothing but calls) and its ``calls``."""

    content: str | None
    calls: list[ParsedCall] = field(default_factory=list)


class ToolParser:
    """One family's format. Subclasses set ``name`` and ``markers`` (the strings that may
    open a call: content is held back from where one begins, or may be beginning) and
    implement :meth:`extract`."""

    name: str = ""
    markers: tuple[str, ...] = ()

    def extract(self, text: str) -> Extracted:
        raise NotImplementedError

    def content_end(self, text: str) -> int:
        """How much of ``text`` (a stream's output so far) can be sent as content now: up
        to the first marker, less any tail that may be a marker's beginning."""
        end = len(text)
        for marker in self.markers:
            at = text.find(marker)
            end = min(end, at if at >= 0 else len(text) - partial_overlap(text, marker))
        return end

    def stream(self) -> CallStream:
        return CallStream(self)


def partial_overlap(text: str, marker: str) -> int:
    """The length of the longest tail of ``text`` that is a proper head of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def dumps(value: object) -> str:
    """Arguments as vLLM writes them (``json.dumps``, non-ASCII kept)."""
    return json.dumps(value, ensure_ascii=False)


def raw_decode(text: str, at: int = 0) -> tuple[object, int]:
    """The JSON value starting at ``at`` and the index just past it (ValueError if none)."""
    return _decoder.raw_decode(text, at)


class CallStream:
    """One streamed answer through a parser: :meth:`feed` the text as it comes, get the
    content that may go out now; :meth:`finish` at the end gives the rest of the content
    and the calls (those :meth:`ToolParser.extract` finds in the whole text)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of ``text`` sent as content

    def feed(self, piece: str) -> str:
        self.text += piece
        end = self.parser.content_end(self.text)
        if end <= self.sent:
            return ""
        out = self.text[self.sent : end]
        self.sent = end
        return out

    def finish(self) -> Extracted:
        """The content not sent yet (None: none) and the calls of the whole text."""
        got = self.parser.extract(self.text)
        sent = self.text[: self.sent]
        content = got.content or ""
        rest = content[len(sent) :] if content.startswith(sent) else ""
        if not got.calls and not content.startswith(sent):  # a parser that drops text
            rest = self.text[self.sent :]
        return Extracted(rest or None, got.calls)
