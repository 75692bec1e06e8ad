"""vLLM's ``/tokenize`` and ``/detokenize``: the served model's tokenizer over HTTP.

Why a front door serves them: it already holds the tokenizer (it tokenizes every prompt, so
the router hashes exactly what the engine will see), and clients that count or build
prompts in tokens -- budget checks, evaluation harnesses with a remote tokenizer -- call
these paths on vLLM. Same authentication as the completions; no replica is involved. The
tokenizer runs on the front door's worker thread, after the same cheap bounds as a prompt.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Annotated, Any

import pydantic
from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from ..agents.tool_template import template_for
from ..agents.tools import ToolConfig, plan_tools, template_messages
from ..errors import APIError, one_line, read_body, validation_error
from ..intake import Intake
from ..openai_api import ChatMessage, Text, TokenId

MAX_DETOKENIZE_IDS = 1 << 20


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")  # as the completions' bodies


class TokenizeRequest(_Strict):
    """A text (``prompt``) or a chat (``messages``, rendered by the model's template)."""

    model: Text | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    tools: list[Any] | None = None  # function tools, shown to the template (vLLM's field)
    add_special_tokens: bool = True  # a text's BOS and the like (vLLM's default)
    add_generation_prompt: bool = True  # a chat's assistant turn opened
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: Text | None = None
    tokens: Annotated[list[TokenId], Field(max_length=MAX_DETOKENIZE_IDS)]


async def _body(request: Request, model: type[pydantic.BaseModel]) -> Any:
    state = request.app.state
    intake: Intake = state.intake
    raw = await read_body(request, state.max_body_bytes, state.body_timeout_s)
    try:
        body = model.model_validate_json(raw)
    except pydantic.ValidationError as exc:
        raise validation_error(list(exc.errors(include_url=False))) from None
    # An adapter's name is served the base model's tokenizer, to a tenant that may use it
    # (authenticated already: its id is in the scope's state).
    tenant_id = request.scope.get("state", {}).get("tenant")
    intake.check_model(body, state.tenants.tenants.get(tenant_id))
    return body


async def tokenize(request: Request) -> JSONResponse:
    intake: Intake = request.app.state.intake
    body: TokenizeRequest = await _body(request, TokenizeRequest)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "Send `prompt` or `messages`, not both.", "invalid_request_error")
    tokenizer = intake.tokenizer
    if body.prompt is not None:
        text = body.prompt
        intake.check_length(len(text))
    else:
        # As a chat renders them (router/api/agents/tools.py): its tools, calls and results too.
        messages = template_messages(body.messages or [])
        plan = plan_tools(SimpleNamespace(tools=body.tools, tool_choice="none"), ToolConfig())
        kw: dict[str, Any] = {"tools": plan.tools} if plan is not None and plan.tools else {}
        with_tools = bool(kw) or any(m["role"] == "tool" or "tool_calls" in m for m in messages)
        template = template_for(tokenizer, with_tools)
        if template is not None:
            kw["chat_template"] = template
        intake.check_length(sum(len(m["content"]) for m in messages) + len(str(body.tools or "")))
        try:
            text = await intake.off_loop(
                lambda: tokenizer.apply_chat_template(
                    messages,
                    add_generation_prompt=body.add_generation_prompt,
                    tokenize=False,
                    **kw,
                )
            )
        except Exception as exc:  # no template, or the template refuses the roles
            raise APIError(
                400, f"cannot render chat: {one_line(str(exc))}", "invalid_request_error"
            ) from None
    special = body.add_special_tokens and body.messages is None  # a template has its own
    ids: list[int] = await intake.off_loop(
        lambda: list(tokenizer(text, add_special_tokens=special).input_ids)
    )
    out: dict[str, Any] = {
        "count": len(ids),
        "max_model_len": intake.max_model_len,
        "tokens": ids,
        "token_strs": tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None,
    }
    return JSONResponse(out)


async def detokenize(request: Request) -> JSONResponse:
    intake: Intake = request.app.state.intake
    body: DetokenizeRequest = await _body(request, DetokenizeRequest)
    if body.tokens:  # the prompts' bound (none: an empty text)
        intake.check_ids(body.tokens, validated=True, param="tokens")
    tokenizer = intake.tokenizer
    text: str = await intake.off_loop(lambda: tokenizer.decode(body.tokens))
    return JSONResponse({"prompt": text})
