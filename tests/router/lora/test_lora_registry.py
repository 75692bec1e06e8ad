"""One front door's LoRA loads and unloads side by side (issue 50), with stand-in replicas:
an unload that waits on a stream holds up no load or unload of another name, and a second
unload of a name answers at once with the documented status (docs/lora.md: 400 "being
loaded or unloaded" while the first runs, 404 once it is gone)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from kvroute.router.api.errors import APIError
from kvroute.router.lora.registry import LoRARegistry

PROMPT_S = 2.0  # what "at once" means here, on a slow shared machine


class _Remote:
    """An actor method as the registry calls it: ``.remote(...)`` gives an awaitable."""

    def __init__(self, fn: Callable[..., Awaitable[Any]]) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Awaitable[Any]:
        return self.fn(*args)


class FakeReplica:
    """Registers whatever it is given, at once."""

    def __init__(self, held: dict[str, str]) -> None:
        self.held = dict(held)
        self.add_lora = _Remote(self._add)
        self.remove_lora = _Remote(self._remove)
        self.list_loras = _Remote(self._list)

    async def _add(self, name: str, path: str) -> str:
        self.held[name] = path
        return path

    async def _remove(self, name: str) -> bool:
        return self.held.pop(name, None) is not None

    async def _list(self) -> dict[str, str]:
        return dict(self.held)


async def test_an_unload_waiting_on_a_stream_blocks_no_other_name() -> None:
    start = {"a": "/ad/a", "b": "/ad/b"}
    replicas = {"r0": FakeReplica(start), "r1": FakeReplica(start)}
    reg = LoRARegistry(["tiny"], start, {n: {"r0", "r1"} for n in start})
    reg.started("a")  # a stream runs on `a`: its unload waits for it
    first = asyncio.ensure_future(reg.unload("a", replicas))
    await asyncio.sleep(0.05)
    assert not first.done() and reg.paths() == {"b": "/ad/b"}  # `a` is gone for new requests
    # Other names go on beside it.
    await asyncio.wait_for(reg.unload("b", replicas), PROMPT_S)
    await asyncio.wait_for(reg.load("c", "/ad/c", replicas), PROMPT_S)
    assert reg.paths() == {"c": "/ad/c"}
    assert all(r.held == {"a": "/ad/a", "c": "/ad/c"} for r in replicas.values())
    # The same name while its unload runs: refused at once, "try again" (400).
    for again in (reg.unload("a", replicas), reg.load("a", "/ad/a2", replicas)):
        with pytest.raises(APIError) as err:
            await asyncio.wait_for(again, PROMPT_S)
        assert err.value.status == 400 and "being loaded or unloaded" in err.value.message
    assert not first.done()
    reg.finished("a")  # the stream ends: the unload finishes
    await asyncio.wait_for(first, PROMPT_S)
    assert all(r.held == {"c": "/ad/c"} for r in replicas.values())
    # Once it is gone: the documented 404 naming `lora_name`, at once.
    with pytest.raises(APIError) as err:
        await asyncio.wait_for(reg.unload("a", replicas), PROMPT_S)
    assert err.value.status == 404 and err.value.param == "lora_name"


async def test_a_sync_never_drops_an_adapter_being_loaded_or_unloaded() -> None:
    """A replica's sync compares it with the registry: a name whose load or unload is
    under way is that call's to decide, not the sync's."""
    replicas = {"r0": FakeReplica({"a": "/ad/a"})}
    reg = LoRARegistry(["tiny"], {"a": "/ad/a"}, {"a": {"r0"}})
    reg.started("a")
    unload = asyncio.ensure_future(reg.unload("a", replicas))
    await asyncio.sleep(0.05)
    await reg.sync(replicas["r0"], "r0")  # `a` is out of the registry, its requests run
    assert replicas["r0"].held == {"a": "/ad/a"}  # still there for the running stream
    reg.finished("a")
    await asyncio.wait_for(unload, PROMPT_S)
    assert replicas["r0"].held == {}
