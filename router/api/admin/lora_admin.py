"""The admin side of LoRA adapters over HTTP, vLLM's endpoints: ``POST
/v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` and ``POST /v1/unload_lora_adapter``
``{"lora_name"}``, with an admin key (``admin_keys`` in the tenants file).

Why admin keys and not vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``: a front door for many
tenants must not let one tenant change what every replica holds; the keys that may read
``/fleet`` (hosts, pids) are the ones trusted with the fleet. A server without keys
answers these only while it listens on loopback, as ``/fleet``.

What a load or unload does across the fleet is :mod:`.lora`'s.
"""

from __future__ import annotations

from typing import Annotated

import pydantic
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ...fleet.tenants import AuthError
from ..errors import APIError, read_body, validation_error

Name = Annotated[str, pydantic.Field(min_length=1, max_length=256)]
Path = Annotated[str, pydantic.Field(min_length=1, max_length=4096)]


class LoadLoRAAdapterRequest(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    lora_name: Name
    lora_path: Path


class UnloadLoRAAdapterRequest(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    lora_name: Name
    lora_int_id: int | None = None  # vLLM's field; accepted, not needed


def require_admin(request: Request, path: str) -> None:
    """Admin keys only: 401 without a known key, 403 for a tenant's key (or for anyone on a
    public server without keys)."""
    state = request.app.state
    if state.tenants.open and state.public:
        raise APIError(
            403,
            f"{path} needs an admin key, and this server has none: give it a tenants file "
            "with admin_keys",
            "permission_error",
            code="not_admin",
        )
    try:
        admin = state.tenants.is_admin(request.headers.get("authorization"))
    except AuthError as exc:
        state.errors["auth"] += 1
        raise APIError(401, str(exc), "invalid_request_error", code="invalid_api_key") from None
    if not admin:
        raise APIError(403, f"{path} needs an admin key", "permission_error", code="not_admin")


async def _body(request: Request, model: type[pydantic.BaseModel]) -> pydantic.BaseModel:
    state = request.app.state
    raw = await read_body(request, state.max_body_bytes, state.body_timeout_s)
    try:
        return model.model_validate_json(raw)
    except pydantic.ValidationError as exc:
        raise validation_error(list(exc.errors(include_url=False))) from None


async def load_lora_adapter(request: Request) -> Response:
    """Registers the adapter on every live replica (and every later one), then names it."""
    require_admin(request, "/v1/load_lora_adapter")
    body = await _body(request, LoadLoRAAdapterRequest)
    assert isinstance(body, LoadLoRAAdapterRequest)
    adapter = await request.app.state.door.load_lora(body.lora_name, body.lora_path)
    return JSONResponse(
        {"status": "ok", "lora_name": adapter.name, "lora_path": adapter.path},
    )


async def unload_lora_adapter(request: Request) -> Response:
    """No new request may name it; this front door's requests on it end first."""
    require_admin(request, "/v1/unload_lora_adapter")
    body = await _body(request, UnloadLoRAAdapterRequest)
    assert isinstance(body, UnloadLoRAAdapterRequest)
    await request.app.state.door.unload_lora(body.lora_name)
    return JSONResponse({"status": "ok", "lora_name": body.lora_name})
