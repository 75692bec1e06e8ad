"""One registered LoRA adapter, and the answers the registry gives about adapters.

Split out of :mod:`.registry` so that what a request and an error see of an adapter
(:class:`Adapter`, :func:`not_found`) stands apart from the registry's calls to the
replicas: the record, a replica's refusal (:class:`AdapterConflictError`, :func:`refusal`)
and a load or unload refused because the name is taken (:func:`taken`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..api.errors import APIError, one_line

__all__ = ["Adapter", "AdapterConflictError", "not_found", "refusal", "taken"]


@dataclass(frozen=True, slots=True)
class Adapter:
    """One registered adapter: its name (what ``model`` says), its folder as the replicas
    registered it (hashed into its blocks), when it was registered (``created``)."""

    name: str
    path: str
    created: int


class AdapterConflictError(ValueError):
    """A replica refused an adapter (the message says why; ``param`` names the field)."""

    def __init__(self, message: str, param: str = "lora_path") -> None:
        super().__init__(message)
        self.param = param


def not_found(model: str) -> APIError:
    """vLLM's answer to a model it does not serve (``NotFoundError``, ``param: model``);
    the same for an adapter the tenant may not use, so a 404 says nothing of others'."""
    return APIError(
        404,
        f"The model `{model[:100]}` does not exist.",
        "NotFoundError",
        "model",
        "model_not_found",
    )


def taken(name: str, why: str) -> APIError:
    """A load or unload the fleet's registry refused: loaded already, or another front
    door is loading or unloading it right now."""
    if why == "loaded":
        message = f"The lora adapter `{name[:100]}` has already been loaded."
    else:
        message = f"The lora adapter `{name[:100]}` is being loaded or unloaded; try again."
    return APIError(400, message, "BadRequestError", "lora_name")


def refusal(exc: BaseException) -> str | None:
    """A replica's refusal (its engine's ValueError, through Ray) as one line; None for
    anything else (a replica that died or did not answer)."""
    cause = getattr(exc, "cause", None) or exc  # Ray's RayTaskError keeps the raised one
    if isinstance(cause, ValueError):
        return one_line(str(cause))
    return None
