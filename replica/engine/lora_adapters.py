"""LoRA adapters in :class:`~.llm_engine.LLMEngine`: registering them, and requests' adapters.

Split out of :mod:`.llm_engine` so the engine's loop reads without the adapters' cases: the
admin calls (``add_lora``, ``remove_lora``, ``list_loras``), a request's adapter resolved at
intake, the scheduler's "is its adapter in memory" check, and the requests ended because
their adapter could not be read. A mixin of ``LLMEngine``; the adapters themselves are the
model runner's :class:`~kvroute.replica.model.lora_store.LoRAStore` (``self.lora``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from kvroute.events.replica_api import GenerateDelta

from ..core.outputs import EngineOutput
from ..core.request import Request

if TYPE_CHECKING:
    from ..core.scheduler import Scheduler
    from ..model.lora_adapter import AdapterSpec
    from ..model.lora_store import LoRAStore
    from .output_processor import RequestState


class EngineLoRA:
    """:class:`~.llm_engine.LLMEngine`'s LoRA adapter methods (its attributes)."""

    lora: LoRAStore | None
    scheduler: Scheduler
    _states: dict[str, RequestState]

    if TYPE_CHECKING:  # the engine's own (output_processor)

        def _fail(self, request_id: str, stage: str, exc: Exception | None) -> EngineOutput: ...

    def add_lora(self, name: str, path: str, spec: AdapterSpec | None = None) -> None:
        """Registers a PEFT adapter folder under ``name`` (checked now, or ``spec``: checked
        already, off this thread, by ``lora.inspect``; read into memory when a request
        first needs it). LoRAError (a ValueError) names what is refused."""
        if self.lora is None:
            raise ValueError("this engine serves no LoRA adapters (enable_lora is off)")
        self._pin_running()  # between steps: what runs now keeps its adapter in memory
        self.lora.register(name, str(path), spec)

    def remove_lora(self, name: str) -> bool:
        """Unregisters an adapter: new requests cannot name it; those already queued or
        running finish with it. False when the name is not registered."""
        return self.lora.unregister(name) if self.lora is not None else False

    def list_loras(self) -> dict[str, str]:
        """Registered adapters: name -> folder."""
        return self.lora.registered() if self.lora is not None else {}

    def _lora_path(self, name: str) -> str:
        if self.lora is None:
            raise ValueError(
                f"lora_name {name!r}: this engine serves no LoRA adapters (enable_lora is off)"
            )
        path = self.lora.path_of(name)
        broken = self.lora.unavailable(name, path)
        if broken is not None:  # a read of it failed since it was registered: fail fast
            raise ValueError(f"model: {broken}")
        return path

    def _lora_ready(self, req: Request) -> bool:
        name, path = req.lora_name, req.lora_path
        return (
            self.lora is not None
            and name is not None
            and path is not None
            and (self.lora.ready(name, path))
        )

    def _lora_failures(self) -> list[EngineOutput]:
        """Ends the waiting requests whose adapter could not be read (each alone, an
        error output); pins the running requests' adapters in memory for this step."""
        assert self.lora is not None
        self._pin_running()  # first: a read settled below must not push out a running one
        outputs: list[EngineOutput] = []
        for (name, path), exc in self.lora.take_failures().items():
            for rid, state in list(self._states.items()):
                req = state.request
                if req.lora_name == name and req.lora_path == path and not req.is_finished:
                    outputs.append(self._fail_lora(rid, exc))
        return outputs

    def _pin_running(self) -> None:
        """The running requests' adapters, kept in memory until the next call."""
        assert self.lora is not None
        keys = {(r.lora_name, r.lora_path) for r in self.scheduler.running}
        self.lora.pin({(n, p) for n, p in keys if n is not None and p is not None})

    def _fail_lora(self, request_id: str, exc: Exception) -> EngineOutput:
        """Ends a request whose adapter cannot be served here (its read failed, or what it
        read is not what was registered): the client's 400 naming the adapter, as for an
        adapter refused when the request came, not a failure of the replica."""
        self._states[request_id].request.error = f"model: {exc}"
        out = self._fail(request_id, "LoRA adapter", None)
        if isinstance(out, GenerateDelta):  # the data plane: a refusal, not an engine fault
            return msgspec.structs.replace(out, failure="invalid")
        return out
