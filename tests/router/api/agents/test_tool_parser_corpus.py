"""kvroute's tool-call parsers read a corpus of model outputs as vLLM's own parsers do.

vLLM (the ``vllm`` extra; skipped without it) is the reference: for each supported format
the corpus has one call, several, text before and after, malformed JSON, a call cut off
mid-way, odd spacing and non-ASCII arguments. A whole output's content and calls must equal
vLLM's ``extract_tool_calls``; the same output streamed in pieces of every size must give
the same calls, and the content vLLM gives, with the two documented exceptions of
:mod:`kvroute.router.api.agents.tool_parsers.base` (a streamed Llama 3 answer keeps the text sent
before a call; a streamed Mistral answer whose calls do not parse keeps the text before
the marker, which vLLM's content drops).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvroute.router.api.agents.tool_parsers import Extracted, ToolParser
from kvroute.router.api.agents.tool_parsers.hermes import HermesParser
from kvroute.router.api.agents.tool_parsers.llama3_json import Llama3JsonParser
from kvroute.router.api.agents.tool_parsers.mistral import MistralParser

pytest.importorskip("vllm.tool_parsers.hermes_tool_parser", reason="vllm not installed")

W = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
T = '{"name": "get_time", "arguments": {"zone": "UTC"}}'
HERMES = [
    "Just text, no call.",
    f"<tool_call>\n{W}\n</tool_call>",
    f"Let me check.\n<tool_call>\n{W}\n</tool_call>",
    f"<tool_call>\n{W}\n</tool_call>\n<tool_call>\n{T}\n</tool_call>",
    f"Two: <tool_call>{W}</tool_call> and <tool_call>{T}</tool_call> done.",
    f"<tool_call>\n{W}\n</tool_call> trailing words",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>',  # bad
    f"<tool_call>\n{W}\n</tool_call>\n<tool_call>\n{{broken\n</tool_call>",
    f"<tool_call>\n{W}",  # cut before the closing tag: the JSON is whole
    '<tool_call>\n{"name": "get_weather", "argum',  # cut mid-call
    'text <tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "f", "arguments": {"q": "caf\\u00e9 \u00fc\u4e2d \\ud83d\\ude00"}}'
    "</tool_call>",
    '<tool_call>{"name":"f","arguments":{"a":[1,2.50,1e3,null,true],"b":{}}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>',  # arguments as text
    "<tool_call></tool_call>",
    "a <tool_ca",  # a partial marker at the end is content after all
    "<tool_call",
    "<<tool_call>>",
]
LLAMA = [
    "Just text.",
    W,
    '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    f"{W}; {T}",
    f"<|python_tag|>{W}",
    f"Sure! {W}",
    f"{W} and then some words",
    "Text with a brace { that is not JSON",
    f"{W}{T}",  # adjacent: vLLM skips the second
    '{"name": "get_weather", "arguments": {"city": "Pa',  # cut mid-call
    '{"arguments": {}}',  # no name
    '{"name": "f", "arguments": {"q": "\u00fc\u4e2d"}, "extra": [1, {"n": 2}]}',
    "<|python_tag|>",
    "{}",
]
MISTRAL = [
    "Just text.",
    f"[TOOL_CALLS] [{W}]",
    f"Sure.[TOOL_CALLS][{W}, {T}]",
    f"[TOOL_CALLS]{W}",  # a bare object
    f"[TOOL_CALLS][{W}] and more words",
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Pa',  # cut mid-call
    "[TOOL_CALLS] not json at all",
    '[TOOL_CALLS][{"name": "f"}, 3, {"arguments": "{\\"a\\": 1}"}]',
    f"[TOOL_CALLS][TOOL_CALLS][{W}]",
    f"x [TOOL_CALLS] [{W}] [TOOL_CALLS] [{T}]",
    'noise [TOOL_CALLS] junk [{"name": "f", "arguments": {}}] junk',
    "[TOOL_CALLS",
]
MISTRAL_V11 = [
    "Just text.",
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}',
    'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}',
    '[TOOL_CALLS]get_weather{"city": "Paris"}',
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"} trailing text',
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Pa',  # cut mid-call
    "[TOOL_CALLS]get_time[ARGS]",
]


class _Tokenizer:
    """What vLLM's parsers read of a tokenizer: its vocabulary."""

    def __init__(self, *specials: str) -> None:
        self.vocab = {s: i for i, s in enumerate(specials)}

    def get_vocab(self) -> dict[str, int]:
        return self.vocab

    def __len__(self) -> int:
        return len(self.vocab)


def _vllm(kind: str) -> Any:
    if kind == "hermes":
        from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

        return Hermes2ProToolParser(_Tokenizer("<tool_call>", "</tool_call>"))
    if kind == "llama3_json":
        from vllm.tool_parsers.llama_tool_parser import Llama3JsonToolParser

        return Llama3JsonToolParser(_Tokenizer("<|python_tag|>"))
    from vllm.tool_parsers.mistral_tool_parser import MistralToolParser

    specials = ("[TOOL_CALLS]", "[ARGS]") if kind == "mistral_v11" else ("[TOOL_CALLS]",)
    return MistralToolParser(_Tokenizer(*specials))


OURS: dict[str, ToolParser] = {
    "hermes": HermesParser(),
    "llama3_json": Llama3JsonParser(),
    "mistral": MistralParser(v11=False),
    "mistral_v11": MistralParser(v11=True),
}
CORPUS = [
    *(("hermes", t) for t in HERMES),
    *(("llama3_json", t) for t in LLAMA),
    *(("mistral", t) for t in MISTRAL),
    *(("mistral_v11", t) for t in MISTRAL_V11),
]
REQUEST = SimpleNamespace(tool_choice="auto", tools=None)


def reference(kind: str, text: str) -> Extracted:
    from kvroute.router.api.agents.tool_parsers import ParsedCall

    got = _vllm(kind).extract_tool_calls(text, REQUEST)
    calls = [ParsedCall(c.function.name, c.function.arguments) for c in got.tool_calls]
    assert got.tools_called == bool(calls)
    return Extracted(got.content, calls)


def streamed(parser: ToolParser, text: str, size: int) -> Extracted:
    stream = parser.stream()
    content = "".join(stream.feed(text[i : i + size]) for i in range(0, len(text), size))
    rest = stream.finish()
    content += rest.content or ""
    return Extracted(content or None, rest.calls)


@pytest.mark.parametrize(("kind", "text"), CORPUS, ids=[f"{k}-{i}" for i, (k, _) in
                                                       enumerate(CORPUS)])  # fmt: skip
def test_whole_and_streamed_outputs_read_as_vllm_reads_them(kind: str, text: str) -> None:
    ref = reference(kind, text)
    ours = OURS[kind]
    assert ours.extract(text) == ref
    sent = text[: ours.content_end(text)]  # streamed as content before the first marker
    if kind == "llama3_json" and ref.calls:
        content = sent or None
    elif (ref.content or "").startswith(sent):
        content = ref.content
    else:  # vLLM's content drops text already sent: the stream keeps it, and the rest
        content = text
    for size in range(1, len(text) + 1):
        got = streamed(ours, text, size)
        assert got.calls == ref.calls, size
        assert got.content == content, size
    assert content == ref.content or kind in ("llama3_json", "mistral"), "an exception more"


def test_the_corpus_exercises_calls_and_refusals() -> None:
    """Each format has outputs with calls, with several, and without any."""
    for kind in OURS:
        counts = [len(reference(kind, t).calls) for k, t in CORPUS if k == kind]
        assert 0 in counts and 1 in counts and max(counts) >= 2, (kind, counts)
