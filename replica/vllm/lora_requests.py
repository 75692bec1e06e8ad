"""LoRA adapters on a vLLM replica: vLLM's ``LoRARequest``s, registered and named here.

Split out of :mod:`.engine` so :class:`~.engine.VllmEngine` reads as the adapter's
lifecycle and surface: the admin calls (``add_lora``, ``remove_lora``, ``list_loras``)
and the ``LoRARequest`` kept per name (vLLM hashes name and path), whose id this replica
assigns. ``VllmLoRA`` is a mixin of ``VllmEngine`` (its attributes); a request names its
adapter and :mod:`.live_requests` looks it up.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .adapt import VllmEngineConfig


class VllmLoRA:
    """:class:`~.engine.VllmEngine`'s LoRA adapter methods (its attributes)."""

    config: VllmEngineConfig
    llm: Any  # vLLM's AsyncLLM
    _loras: dict[str, Any]  # name -> vLLM's LoRARequest
    _lora_ids: int

    if TYPE_CHECKING:  # the engine's own

        def call(self, fn: Callable[[Any], Awaitable[Any]]) -> Awaitable[Any]: ...

    async def add_lora(self, name: str, path: str) -> str:
        """Registers a PEFT folder under ``name`` in vLLM (read and checked there); returns
        the path vLLM hashes with. A refusal is a ValueError naming the field."""
        return str(await self.call(lambda e: e._add_lora(name, path)))

    async def remove_lora(self, name: str) -> bool:
        return bool(await self.call(lambda e: e._remove_lora(name)))

    async def list_loras(self) -> dict[str, str]:
        return {name: req.lora_path for name, req in self._loras.items()}

    async def _add_lora(self, name: str, path: str) -> str:
        from vllm.lora.request import LoRARequest

        if not name:
            raise ValueError("lora_name must not be empty")
        old = self._loras.get(name)
        if old is not None:
            if old.lora_path != str(path):
                raise ValueError(
                    f"LoRA adapter {name!r} is already registered from {old.lora_path}"
                )
            return str(old.lora_path)
        if not self.config.lora_modules and not self.config.engine_args.get("enable_lora"):
            raise ValueError("this replica serves no LoRA adapters (start it with --enable-lora)")
        if not (Path(path) / "adapter_config.json").is_file():
            raise ValueError(
                f"lora_path {path}: no adapter_config.json (not a PEFT adapter folder)"
            )
        self._lora_ids += 1
        request = LoRARequest(name, self._lora_ids, str(path))
        try:
            await self.llm.add_lora(request)
        except Exception as exc:  # vLLM's own check (rank, targets): the folder's fault
            raise ValueError(f"lora_path {path}: {exc}") from None
        self._loras[name] = request
        return str(request.lora_path)

    async def _remove_lora(self, name: str) -> bool:
        request = self._loras.pop(name, None)
        if request is None:
            return False
        await self.llm.remove_lora(request.lora_int_id)
        return True
