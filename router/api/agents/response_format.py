"""A request's structured-output constraint, from OpenAI's ``response_format`` or vLLM's
``structured_outputs``, checked at the front door so a bad one is a 400 naming the field.

Why here and not in the models: both fields are free-form JSON in the request models (their
shapes vary by kind), so one function reads them, as vLLM does: ``response_format`` (JSON
mode, or a JSON schema) overrides the kind set in ``structured_outputs`` and keeps its other
options. Whether a schema, regex or grammar compiles is the replica's to say (it compiles
against its tokenizer): a constraint that does not is refused there, also as a 400.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from kvroute.events.replica_api import BoundsError, StructuredOutputs

from ..errors import APIError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
OPTIONS = ("disable_any_whitespace",)


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, "invalid_request_error", param)


def structured_outputs(body: Any) -> StructuredOutputs | None:
    """The constraint ``body`` asks for, or None (none, or ``response_format: text``)."""
    fields = _from_vllm(getattr(body, "structured_outputs", None))
    kind = _from_response_format(getattr(body, "response_format", None))
    if kind is not None:
        fields = {k: v for k, v in (fields or {}).items() if k in OPTIONS} | kind
    if fields is None:
        return None
    try:
        return StructuredOutputs(**fields)
    except BoundsError as exc:
        raise _bad(str(exc), "response_format" if kind else "structured_outputs") from None


def _from_vllm(so: Any) -> dict[str, Any] | None:
    param = "structured_outputs"
    if so is None:
        return None
    if not isinstance(so, dict):
        raise _bad("`structured_outputs` must be an object.", param)
    unknown = set(so) - set(KINDS) - set(OPTIONS)
    set_unknown = sorted(k for k in unknown if so[k] not in (None, False))
    if set_unknown:
        raise _bad(f"`structured_outputs.{set_unknown[0]}` is not supported.", param)
    fields: dict[str, Any] = {}
    for k in (*KINDS, *OPTIONS):
        v = so.get(k)
        if v is None:
            continue
        if k == "json" and not isinstance(v, str):
            v = _schema_text(v, f"{param}.json")
        elif k == "json":  # a schema given as text: JSON, or the replica's parser says worse
            try:
                json.loads(v)
            except ValueError:
                raise _bad(f"`{param}.json` is not valid JSON.", f"{param}.json") from None
        elif k in ("json_object", "disable_any_whitespace") and not isinstance(v, bool):
            raise _bad(f"`{param}.{k}` must be a boolean.", f"{param}.{k}")
        fields[k] = v
    return fields


def _from_response_format(rf: Any) -> dict[str, Any] | None:
    param = "response_format"
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise _bad(
                "`response_format.json_schema` must be an object with a `name` and a `schema`.",
                f"{param}.json_schema",
            )
        schema = spec.get("schema")
        if schema is None:  # a name alone: any JSON object
            return {"json_object": True}
        return {"json": _schema_text(schema, f"{param}.json_schema.schema")}
    raise _bad(
        "`response_format.type` must be `text`, `json_object` or `json_schema`.", f"{param}.type"
    )


def _schema_text(schema: Any, param: str) -> str:
    """A JSON schema as the text the replica compiles."""
    if not isinstance(schema, dict):
        raise _bad(f"`{param}` must be a JSON schema (an object).", param)
    return msgspec.json.encode(schema).decode()
