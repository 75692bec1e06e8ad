"""OpenAI's Responses API request (``POST /v1/responses``) read as the chat it stands for.

Why a translation and not a second path: a Responses request is a chat -- ``instructions``
a system message, ``input`` messages, function calls and their outputs, function tools,
``text.format`` a ``response_format`` -- so it goes through the very intake a chat does
(admission, tenants and their salts, LoRA adapters in ``model``, limits, the template with
tools, tokenization, routing), and its answer is read by the same tool plan
(:mod:`.tools`). What is the Responses API's own is checked here, each refusal a 400
naming the Responses field (``input.3.call_id``, ``tools.0.name``); a chat-level refusal
raised later is renamed to the Responses field it came from (:func:`responses_param`).

Stateless, as ``store: false``: nothing is kept, so ``previous_response_id`` and
``conversation`` (state kept by the server) are refused with a 400 that says to send the
whole input; ``background`` likewise.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from ..errors import APIError
from ..openai_api import Text
from .tools import check_function_tool

# vLLM's extensions passed on to the chat as they are.
PASSED = ("seed", "top_k", "min_p", "repetition_penalty", "cache_salt", "ignore_eos",
          "min_tokens", "user", "stop", "structured_outputs")  # fmt: skip
ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


def _bad(message: str, param: str, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


class ResponsesRequest(BaseModel):
    """The fields read here; items, tools and ``text`` are free-form and checked by
    :func:`to_chat`, which names the field at fault. Unknown fields are ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: Text | None = None
    input: Text | list[Any]
    instructions: Text | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    text: dict[str, Any] | None = None
    stream: bool | None = False
    store: bool | None = None  # accepted; nothing is stored
    previous_response_id: Text | None = None
    conversation: Any = None
    background: bool | None = None
    metadata: Annotated[dict[str, Text], Field(max_length=16)] | None = None
    truncation: Text | None = None
    reasoning: Any = None


@dataclass(slots=True)
class ChatForm:
    """The chat a Responses request stands for, and what its answer echoes back."""

    chat: dict[str, Any]
    tools: list[dict[str, Any]] = field(default_factory=list)  # as the request gave them
    text_format: dict[str, Any] = field(default_factory=lambda: {"type": "text"})


def to_chat(body: ResponsesRequest, raw: dict[str, Any]) -> ChatForm:
    """The chat body (a Chat Completions request) for ``body``; ``raw``: the request's
    JSON, for the vLLM extensions passed on."""
    if body.previous_response_id is not None or body.conversation is not None:
        param = "previous_response_id" if body.previous_response_id else "conversation"
        raise _bad(
            f"`{param}` needs responses stored on the server; this server stores none "
            "(as `store: false`): send the whole conversation in `input`.",
            param,
            "unsupported_parameter",
        )
    if body.background:
        raise _bad("`background` responses are not served.", "background", "unsupported_parameter")
    if body.truncation not in (None, "disabled"):
        raise _bad('`truncation` must be "disabled".', "truncation", "unsupported_parameter")
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
    else:
        for i, item in enumerate(body.input):
            _add_item(messages, item, f"input.{i}")
    if not messages:
        raise _bad("`input` holds no message.", "input")
    chat: dict[str, Any] = {"messages": messages, "stream": bool(body.stream)}
    if body.model is not None:
        chat["model"] = body.model
    for name in ("temperature", "top_p", "parallel_tool_calls"):
        if getattr(body, name) is not None:
            chat[name] = getattr(body, name)
    if body.max_output_tokens is not None:
        chat["max_completion_tokens"] = body.max_output_tokens
    chat.update({k: raw[k] for k in PASSED if k in raw})
    form = ChatForm(chat)
    if body.tools:
        form.tools = body.tools
        chat["tools"] = [_tool(t, f"tools.{i}") for i, t in enumerate(body.tools)]
    if body.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(body.tool_choice)
    if body.text is not None and body.text.get("format") is not None:
        form.text_format = body.text["format"]
        chat["response_format"] = _format(body.text["format"])
    return form


def _add_item(messages: list[dict[str, Any]], item: Any, at: str) -> None:
    if not isinstance(item, dict):
        raise _bad("An input item must be an object.", at)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ROLES:
            raise _bad(f"A message's `role` must be one of {', '.join(ROLES)}.", f"{at}.role")
        messages.append({"role": role, "content": _content(item.get("content"), at)})
    elif kind == "function_call":
        call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments")
        for key, value in (("call_id", call_id), ("name", name), ("arguments", args)):
            if not isinstance(value, str):
                raise _bad(f"A function call needs `{key}` (a string).", f"{at}.{key}")
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":  # calls of one turn: one message
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        call_id, output = item.get("call_id"), item.get("output")
        if not isinstance(call_id, str):
            raise _bad("A function call output needs `call_id` (a string).", f"{at}.call_id")
        if isinstance(output, list):
            output = _content(output, at, "output")
        if not isinstance(output, str):
            raise _bad("A function call output needs `output` (a string).", f"{at}.output")
        messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
    elif kind == "reasoning":
        return  # a reasoning model's earlier thoughts: a model without them reads none
    else:
        raise _bad(
            f"Input items of type {str(kind)[:40]!r} are not served (messages, "
            "function_call and function_call_output are).",
            f"{at}.type",
            "unsupported_parameter",
        )


def _content(content: Any, at: str, key: str = "content") -> str:
    """A message's content as text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"`{key}` must be a string or a list of parts.", f"{at}.{key}")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("text", part.get("refusal")) if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(text, str):
            raise _bad(
                f"Content parts of type {str(kind)[:40]!r} are not served (a text model is): "
                "send input_text parts.",
                f"{at}.{key}.{j}",
                "unsupported_parameter",
            )
        out.append(text)
    return "".join(out)


def _tool(tool: Any, at: str) -> dict[str, Any]:
    """A flat function tool in the chat's nested shape (the chat's intake checks the rest)."""
    check_function_tool(tool, at)
    fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice  # "none", "auto", "required", or what the chat's check refuses


def _format(fmt: Any) -> dict[str, Any]:
    param = "text.format"
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("name"), str) or not isinstance(fmt.get("schema"), dict):
            raise _bad("`text.format` json_schema needs a `name` and a `schema`.", param)
        spec = {"name": fmt["name"], "schema": fmt["schema"], "strict": fmt.get("strict")}
        return {"type": "json_schema", "json_schema": spec}
    raise _bad("`text.format.type` must be text, json_object or json_schema.", f"{param}.type")


# A chat field in a refusal, as the Responses field it came from.
_RENAMES = [
    (re.compile(r"^max_completion_tokens|^max_tokens"), "max_output_tokens"),
    (re.compile(r"^response_format(\.json_schema)?"), "text.format"),
    (re.compile(r"^tools\.(\d+)\.function"), r"tools.\1"),
    (re.compile(r"^tool_choice\.function"), "tool_choice"),
    (re.compile(r"^messages(\.\d+)?"), "input"),
    (re.compile(r"^prompt$"), "input"),
]


def responses_param(param: str | None) -> str | None:
    """The Responses field a chat-level refusal's ``param`` stands for."""
    if param is None:
        return None
    for pattern, repl in _RENAMES:
        if pattern.match(param):
            return pattern.sub(repl, param, count=1)
    return param
