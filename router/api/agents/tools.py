"""Tool calling in ``/v1/chat/completions``, as vLLM serves it: a request's ``tools`` and
``tool_choice`` checked (a 400 naming the field), the tools handed to the chat template,
and the model's output read back as OpenAI's ``tool_calls``.

Why the three ways of reading an answer (:class:`ToolPlan`):
- ``auto``: the model decides; its text goes through the family's parser
  (``--tool-call-parser``, :mod:`.tool_parsers`), as vLLM does with
  ``--enable-auto-tool-choice``. Without it, ``auto`` is refused (vLLM's rule), since no
  call could be read back.
- ``required`` and a named function: the output is held to the tools' schemas by the
  structured-output constraint (xgrammar on the replica), as vLLM does: a JSON array of
  ``{"name", "parameters"}`` for ``required`` (one item without ``parallel_tool_calls``),
  the named function's arguments alone otherwise. No parser is needed, and even a random
  model's calls validate. The JSON is compact (``disable_any_whitespace``): a small model
  could otherwise fill ``max_tokens`` with blanks.
- ``none``: the tools are shown to the template; the text is content.

``finish_reason`` is ``tool_calls`` for ``auto`` with calls and ``required``, ``stop``
for a named function (OpenAI's and vLLM's rule). The template is the model's own (through
transformers' ``apply_chat_template(tools=...)``); :mod:`.tool_template` covers a ChatML
model whose template cannot show tools.
"""

from __future__ import annotations

import json
import re
import string
from dataclasses import dataclass
from typing import Any, Literal

from kvroute.events.replica_api import BoundsError, StructuredOutputs

from ..errors import APIError, new_id
from .tool_parsers import CallStream, ParsedCall, ToolParser, make_parser
from .tool_parsers.base import raw_decode

Mode = Literal["none", "auto", "required", "named"]
MAX_TOOLS = 128  # OpenAI's limit
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for a function's name
_ALNUM = string.ascii_letters + string.digits
EMPTY_OBJECT = {"type": "object", "properties": {}}


def _bad(message: str, param: str, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


@dataclass(frozen=True, slots=True)
class ToolConfig:
    """The server's tool-calling flags: ``--tool-call-parser`` and
    ``--enable-auto-tool-choice`` (vLLM's)."""

    parser: str | None = None
    auto: bool = False

    def __post_init__(self) -> None:
        if self.auto and self.parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if self.parser is not None:
            make_parser(self.parser)  # the name checked now, not on the first request


@dataclass(frozen=True, slots=True)
class Function:
    name: str
    parameters: dict[str, Any]  # its JSON schema (an empty object's when none was given)


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a request asks of tools, checked: the tools as the template gets them, the
    mode, and how its answer is read."""

    tools: list[dict[str, Any]]
    functions: dict[str, Function]
    mode: Mode
    named: str | None = None
    parallel: bool = True
    parser: ToolParser | None = None
    markers: dict[int, str] | None = None  # see :func:`special_markers`

    def text_of(self, text: str, ids: Any) -> str:
        """A delta's text with the parser's markers put back where the replica's
        detokenizer skipped them as special tokens (at the delta's head when the marker
        is its first token, else at its end: a delta is one token but after a failover)."""
        markers = self.markers
        if not markers or not ids:
            return text
        found = "".join(markers[t] for t in ids if t in markers)
        if not found:
            return text
        return found + text if ids[0] in markers else text + found

    def structured(self) -> StructuredOutputs | None:
        """The constraint that holds a forced call to its schema (None: not forced)."""
        if self.mode == "named":
            assert self.named is not None
            schema: dict[str, Any] = self.functions[self.named].parameters
        elif self.mode == "required":
            items = [
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [f.name]},
                        "parameters": f.parameters,
                    },
                    "required": ["name", "parameters"],
                }
                for f in self.functions.values()
            ]
            schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
            if not self.parallel:
                schema["maxItems"] = 1
        else:
            return None
        try:
            return StructuredOutputs(json=json.dumps(schema), disable_any_whitespace=True)
        except BoundsError as exc:  # the schemas are too large to send as one constraint
            param = "tools" if self.mode == "required" else "tool_choice"
            raise _bad(f"The tools' schemas as a constraint: {exc}", param) from None

    def read(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """A whole output's content and calls."""
        if self.mode == "named":
            assert self.named is not None
            return None, [ParsedCall(self.named, text)]
        if self.mode == "required":
            calls = _required_calls(text)[: None if self.parallel else 1]
            return (None, calls) if calls else (text, [])
        if self.mode == "auto" and self.parser is not None:
            got = self.parser.extract(text)
            calls = got.calls if self.parallel else got.calls[:1]
            return got.content, calls
        return text, []

    def finish_reason(self, reason: str | None, calls: list[ParsedCall]) -> str | None:
        if calls and (self.mode == "auto" or (self.mode == "required" and reason == "stop")):
            return "tool_calls"
        return reason

    def call_id(self) -> str:
        """A call's id: OpenAI's shape, or the nine letters and digits Mistral's
        templates insist on."""
        if self.parser is not None and self.parser.name == "mistral":
            value = int(new_id(), 16)
            return "".join(_ALNUM[(value >> (6 * i)) % len(_ALNUM)] for i in range(9))
        return f"call_{new_id()[:24]}"

    def tool_calls(self, calls: list[ParsedCall]) -> list[dict[str, Any]]:
        """The calls as a whole answer's ``message.tool_calls``."""
        return [
            {"id": self.call_id(), "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ]  # fmt: skip


def _required_calls(text: str) -> list[ParsedCall]:
    """The calls of ``required``'s JSON array: every whole item at its head. An answer cut
    short (``length``) keeps the items it finished (vLLM fails such a request); a stream
    sends each item as it closes, so it gives the same calls."""
    calls = []
    at = _skip(text, 0)
    if not text.startswith("[", at):
        return []
    at += 1
    while True:
        at = _skip(text, at)
        try:
            item, at = raw_decode(text, at)
        except ValueError:  # the array's end, or an item not finished
            return calls
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return calls  # not a call (the schema allows none): the calls before it
        args = json.dumps(item.get("parameters", {}), ensure_ascii=False)
        calls.append(ParsedCall(item["name"], args))
        at = _skip(text, at)
        if not text.startswith(",", at):
            return calls
        at += 1


def _skip(text: str, at: int) -> int:
    """The index of the first non-blank character from ``at``."""
    while at < len(text) and text[at] in " \t\n\r":
        at += 1
    return at


def special_markers(tokenizer: Any, parser: ToolParser) -> dict[int, str]:
    """The token ids of ``parser``'s markers that ``tokenizer`` counts as special tokens
    (Mistral's ``[TOOL_CALLS]``, Llama 3's ``<|python_tag|>``). Replicas decode text
    without special tokens, so their text lacks these markers; vLLM keeps special tokens
    in a request with tools instead. Empty when none is (``tiny``, Qwen's ``<tool_call>``)."""
    special = set(getattr(tokenizer, "all_special_tokens", None) or ())
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    special |= {str(t) for t in decoder.values() if getattr(t, "special", False)}
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # a stand-in tokenizer: no markers to put back
        return {}
    return {vocab[m]: m for m in parser.markers if m in special and m in vocab}


def plan_tools(
    body: Any, config: ToolConfig, tokenizer: Any = None, markers: dict[int, str] | None = None
) -> ToolPlan | None:
    """The request's tool plan (None: no tools and no ``tool_choice``), or a 400 naming
    the field at fault. ``markers``: :func:`special_markers` for the configured parser."""
    tools, choice = getattr(body, "tools", None), getattr(body, "tool_choice", None)
    if not tools and choice in (None, "none"):
        return None
    functions = _functions(tools)
    if choice is None:
        choice = "auto"
    named = None
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict):
            raise _bad(
                '`tool_choice` must be "none", "auto", "required" or '
                '{"type": "function", "function": {"name": ...}}.',
                "tool_choice",
            )
        named = fn.get("name")
        if not isinstance(named, str) or named not in functions:
            raise _bad(
                f"`tool_choice` names a function not in `tools`: {str(named)[:64]!r}.",
                "tool_choice.function.name",
            )
        mode: Mode = "named"
    elif choice in ("none", "auto", "required"):
        mode = choice
    else:
        raise _bad(
            '`tool_choice` must be "none", "auto", "required" or a named function.',
            "tool_choice",
        )
    if mode == "auto" and not config.auto:
        raise _bad(
            '`tool_choice: "auto"` (the default with `tools`) needs the server started with '
            "--enable-auto-tool-choice --tool-call-parser NAME; send `tool_choice` "
            '"required", a named function, or "none".',
            "tool_choice",
            "unsupported_parameter",
        )
    if not functions and mode != "none":
        raise _bad(f'`tool_choice: "{mode}"` needs `tools`.', "tool_choice")
    if mode in ("required", "named") and (
        getattr(body, "response_format", None) is not None
        or getattr(body, "structured_outputs", None) is not None
    ):
        raise _bad(
            f"`tool_choice: {mode}` constrains the output to the tools' schemas; it cannot "
            "be combined with `response_format` or `structured_outputs`.",
            "tool_choice",
        )
    parallel = getattr(body, "parallel_tool_calls", None)
    parser = make_parser(config.parser, tokenizer) if mode == "auto" and config.parser else None
    return ToolPlan(
        tools=[{"type": "function", "function": t} for t in tools or ()],
        functions=functions,
        mode=mode,
        named=named,
        parallel=parallel is not False,
        parser=parser,
        markers=markers if parser is not None else None,
    )


def check_function_tool(tool: Any, at: str) -> None:
    """That ``tool`` (at ``at``) is a function tool: the check a chat's nested shape and the
    Responses API's flat one share, so both refuse the same with the same words."""
    if not isinstance(tool, dict):
        raise _bad("A tool must be an object.", at)
    if tool.get("type") != "function":
        raise _bad(
            f"Only `function` tools are served; got {str(tool.get('type'))[:40]!r}.",
            f"{at}.type",
            "unsupported_parameter",
        )


def _functions(tools: Any) -> dict[str, Function]:
    if tools is None:
        return {}
    if not isinstance(tools, list):
        raise _bad("`tools` must be a list of function tools.", "tools")
    if len(tools) > MAX_TOOLS:
        raise _bad(f"`tools` may list at most {MAX_TOOLS} tools.", "tools")
    out: dict[str, Function] = {}
    for i, tool in enumerate(tools):
        at = f"tools.{i}"
        check_function_tool(tool, at)
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise _bad("A function tool needs a `function` object.", f"{at}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise _bad(
                "A function's `name` must be 1-64 letters, digits, `_` or `-`.",
                f"{at}.function.name",
            )
        if name in out:
            raise _bad(f"Two tools are named {name!r}.", f"{at}.function.name")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise _bad("`description` must be a string.", f"{at}.function.description")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise _bad(
                "`parameters` must be a JSON schema (an object).", f"{at}.function.parameters"
            )
        out[name] = Function(name, params if params else EMPTY_OBJECT)
    return out


def template_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """The chat's messages as a template reads them: an assistant's ``tool_calls`` with
    their arguments parsed (templates write them with ``tojson``, as vLLM hands them over),
    a tool result's ``tool_call_id``, a ``name`` where given."""
    out = []
    for i, m in enumerate(messages):
        d: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            d["tool_calls"] = [_history_call(c, f"messages.{i}.tool_calls.{j}")
                               for j, c in enumerate(m.tool_calls)]  # fmt: skip
        out.append(d)
    return out


def _history_call(call: Any, at: str) -> dict[str, Any]:
    try:
        args = json.loads(call.function.arguments)
    except ValueError:
        raise _bad("A tool call's `arguments` must be JSON.", f"{at}.function.arguments") from None
    return {"id": call.id, "type": "function",
            "function": {"name": call.function.name, "arguments": args}}  # fmt: skip


class ToolStream:
    """One streamed answer read as it comes: :meth:`feed` each text piece, get the deltas
    to send (OpenAI's ``delta`` objects); :meth:`finish` gives the last ones and the
    finish reason. A named function's arguments stream as they come; each of
    ``required``'s calls goes out as its item of the array closes; a parser's calls go out
    when the output ends (:mod:`.tool_parsers.base`). A stream's calls are always the
    whole answer's."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.started = False
        self.sent = 0  # calls sent
        self.parsed: CallStream | None = None
        if plan.mode == "auto" and plan.parser is not None:
            self.parsed = plan.parser.stream()

    def feed(self, piece: str, ids: Any = None) -> list[dict[str, Any]]:
        """``piece``: a delta's text; ``ids``: its token ids (for markers put back)."""
        piece = self.plan.text_of(piece, ids)
        mode = self.plan.mode
        if mode == "named":
            return self._named(piece)
        if self.parsed is not None:
            content = self.parsed.feed(piece)
            return [{"content": content}] if content else []
        if mode == "required":
            self.text += piece
            if "}" not in piece:  # no item can have closed
                return []
            calls = _required_calls(self.text)
            if not self.plan.parallel:
                calls = calls[:1]
            return self._calls(calls)
        return [{"content": piece}] if piece else []

    def _calls(self, calls: list[ParsedCall]) -> list[dict[str, Any]]:
        """The deltas of the calls not sent yet: each its head (index, id, name), then its
        arguments."""
        out = []
        for i in range(self.sent, len(calls)):
            call = calls[i]
            head = {"index": i, "id": self.plan.call_id(), "type": "function",
                    "function": {"name": call.name, "arguments": ""}}  # fmt: skip
            out.append({"tool_calls": [head]})
            out.append({"tool_calls": [{"index": i, "function": {"arguments": call.arguments}}]})
        self.sent = max(self.sent, len(calls))
        return out

    def _named(self, piece: str) -> list[dict[str, Any]]:
        out = []
        if not self.started:
            self.started = True
            head = {"index": 0, "id": self.plan.call_id(), "type": "function",
                    "function": {"name": self.plan.named, "arguments": ""}}  # fmt: skip
            out.append({"tool_calls": [head]})
        if piece:
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
        return out

    def finish(self, reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        mode = self.plan.mode
        if mode == "named":
            return self._named(""), reason
        calls: list[ParsedCall] = []
        out: list[dict[str, Any]] = []
        if self.parsed is not None:
            got = self.parsed.finish()
            calls = got.calls if self.plan.parallel else got.calls[:1]
            if got.content:
                out.append({"content": got.content})
        elif mode == "required":
            content, calls = self.plan.read(self.text)
            if content:
                out.append({"content": content})
        out += self._calls(calls)
        return out, self.plan.finish_reason(reason, calls)
