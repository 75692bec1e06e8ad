"""One registered LoRA adapter, the fleet's adapters a front door starts from, and the
answers the registry gives about adapters.

Split out of :mod:`.registry` so that what a request and an error see of an adapter
(:class:`Adapter`, :func:`not_found`) stands apart from the registry's calls to the
replicas: the records (:class:`Adapter`, :class:`FleetLoRAs`), a replica's refusal
(:class:`AdapterConflictError`, :func:`refusal`), a load refused for its arguments
(:func:`check_load`) or by the replicas (:func:`not_loaded`), an unload of an unknown name
(:func:`unknown`), and a load or unload refused because the name is taken (:func:`taken`).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from ..api.errors import APIError, one_line
from ..fleet.names import control_char

__all__ = [
    "Adapter",
    "AdapterConflictError",
    "FleetLoRAs",
    "check_load",
    "not_found",
    "not_loaded",
    "refusal",
    "taken",
    "unknown",
]


@dataclass(frozen=True, slots=True)
class Adapter:
    """One registered adapter: its name (what ``model`` says), its folder as the replicas
    registered it (hashed into its blocks), when it was registered (``created``)."""

    name: str
    path: str
    created: int


@dataclass(frozen=True, slots=True)
class FleetLoRAs:
    """What a front door's registry starts from: ``paths`` (name -> folder, as the replicas
    registered it) and ``holders`` (name -> the replica ids that hold it)."""

    paths: dict[str, str]
    holders: dict[str, frozenset[str]]


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


def check_load(name: str, path: str, base_names: Collection[str]) -> None:
    """Raises :class:`APIError` (400, naming the field) for a load that cannot be: no name, a
    control character in it, no path, or a base model's name."""
    if not name:
        raise APIError(400, "`lora_name` must be given", "BadRequestError", "lora_name")
    if (bad := control_char(name)) is not None:  # it becomes a /metrics label, log words
        why = f"`lora_name` must not hold a control character ({bad})"
        raise APIError(400, why, "BadRequestError", "lora_name")
    if not path:
        raise APIError(400, "`lora_path` must be given", "BadRequestError", "lora_path")
    if name in base_names:
        raise APIError(
            400,
            f"`lora_name` {name[:100]!r} is the base model's name",
            "BadRequestError",
            "lora_name",
        )


def not_loaded(name: str, why: str | None) -> APIError:
    """A load the replicas refused (``why``: the first refusal) or none answered (None)."""
    return APIError(
        400,
        f"LoRA adapter `{name[:100]}` not loaded: {why or 'no replica answered'}",
        "BadRequestError",
        "lora_name" if why and "lora_name" in why else "lora_path",
    )


def unknown(name: str) -> APIError:
    """An unload of an adapter that is not registered."""
    return APIError(
        404,
        f"The lora adapter `{name[:100]}` cannot be found.",
        "NotFoundError",
        "lora_name",
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
