"""A vLLM replica's load and stats: the scheduler's figures polled, or estimated here.

Split out of :mod:`.engine`: the watcher task that polls vLLM's scheduler through the
utility call kvroute's plugin adds (:mod:`.plugin`) while requests run, and notices a dead
engine core; the estimate from this replica's own requests when the plugin is not loaded;
and what ``stats()`` reports. ``VllmLoad`` is a mixin of :class:`~.engine.VllmEngine`
(its attributes).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from kvroute.events.load import LoadReport

from .adapt import LiveRequest, estimate_load
from .plugin import LOAD_METHOD

if TYPE_CHECKING:
    from .engine import VllmEngine

log = logging.getLogger("kvroute.replica.vllm.engine")  # the engine's log, as before

LOAD_POLL_S = 0.05  # scheduler load polled this often while requests run
IDLE_POLL_S = 0.5  # and this often while none do (engine death is noticed here too)
LOAD_CALL_TIMEOUT_S = 5.0  # a load poll unanswered this long (a dead engine core) is skipped


class VllmLoad:
    """:class:`~.engine.VllmEngine`'s load watcher (its attributes)."""

    llm: Any  # vLLM's AsyncLLM
    load: LoadReport
    num_blocks: int
    block_size: int
    _stopped: bool
    _plugin: bool
    _live: dict[str, LiveRequest]

    if TYPE_CHECKING:  # the engine's own (live_requests)

        def _died(self, exc: BaseException, *, shutdown: bool = False) -> None: ...

    async def _watch(self) -> None:
        """Polls the scheduler's load while requests run (and notices a dead engine)."""
        while not self._stopped:
            if self.llm.errored:
                self._died(self.llm.dead_error)
                return
            busy = bool(self._live)
            report = await self._read_load()
            if report != self.load:  # a new object only on a change: the data plane's cue
                self.load = report
            await asyncio.sleep(LOAD_POLL_S if busy else IDLE_POLL_S)

    async def _read_load(self) -> LoadReport:
        if self._plugin:
            try:
                fields = await asyncio.wait_for(
                    self.llm.engine_core.call_utility_async(LOAD_METHOD), LOAD_CALL_TIMEOUT_S
                )
                return LoadReport(**dict(zip(LoadReport.__struct_fields__, fields, strict=False)))
            except TimeoutError:  # a killed engine core may never answer: the watcher goes
                return self.load  # back to asking vLLM whether it has died
            except Exception as exc:
                if self.llm.errored:
                    return self.load
                self._plugin = False
                log.warning(
                    "kvroute's vLLM plugin is not loaded in the engine core (%s): load is "
                    "estimated from this replica's own requests",
                    exc,
                )
        return self._estimate_load()

    def _estimate_load(self) -> LoadReport:
        return estimate_load(list(self._live.values()), self.num_blocks, self.block_size)


async def engine_stats(engine: VllmEngine) -> dict[str, Any]:
    """What ``VllmEngine.stats`` reports, read on the engine's loop."""
    import vllm

    report = await engine._read_load()
    return {
        "engine": "vllm",
        "vllm_version": vllm.__version__,
        "live_requests": len(engine._live),
        "load_source": "scheduler" if engine._plugin else "estimate",
        **{f: getattr(report, f) for f in report.__struct_fields__},
    }
