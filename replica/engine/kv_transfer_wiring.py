"""P/D and prefix fetch in :class:`~.llm_engine.LLMEngine`: its side of kv_transfer, wired.

Split out of :mod:`.llm_engine` so the engine's start-up and step read without the
transfer's parts: the sender that lends this replica's blocks under leases (and the ZeroMQ
server in front of it), the :class:`KVHandoff` a prefill-only request ends with, and the
transfer's counters in ``stats()``. The transfer itself is :mod:`kvroute.replica.kv_transfer`;
the link this engine pulls over is made in ``LLMEngine.__init__`` (the KV tiers need it).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from kvroute.events.kv_transfer import KVHandoff

if TYPE_CHECKING:  # torch: a cost-model replica never imports it
    from ..core.kv_cache_manager import KVCacheManager
    from ..core.request import Request
    from ..core.scheduler import Scheduler
    from ..kv_tiers.tiers import KVTiers
    from ..kv_transfer.plane import KVPlaneServer, PlaneLink
    from ..kv_transfer.sender import KVSender
    from .config import EngineConfig


def build_kv_sender(
    config: EngineConfig, kv_cache_manager: KVCacheManager, runner: Any, scheduler: Scheduler
) -> KVSender | None:
    """The sender of this replica's leased blocks, its leases given to the scheduler
    (None: kv_transfer is off)."""
    if not config.kv_transfer:
        return None
    from ..kv_transfer.leases import Leases
    from ..kv_transfer.sender import BlockReader, KVSender

    leases = Leases(kv_cache_manager.block_pool, config.kv_lease_s)
    scheduler.use_leases(leases)
    replica_id = config.replica_id or f"engine-{os.urandom(6).hex()}"
    return KVSender(leases, BlockReader(runner.kv_caches), replica_id)


def build_kv_plane(
    config: EngineConfig, kv_sender: KVSender | None, plane_link: PlaneLink | None
) -> KVPlaneServer | None:
    """The ZeroMQ server of the sender's blocks, when the engine pulls over ZeroMQ too."""
    if kv_sender is None or plane_link is None:
        return None
    from ..kv_transfer.plane import KVPlaneServer

    return KVPlaneServer(kv_sender, config.kv_transfer_bind)


def hand_off(
    scheduler: Scheduler, sender: KVSender | None, lease_s: float, req: Request
) -> KVHandoff:
    """Ends ``req`` here with its prompt blocks leased (see :meth:`Scheduler.hand_off`)."""
    assert sender is not None
    lease = scheduler.hand_off(req)
    return KVHandoff(
        replica_id=sender.replica_id,
        endpoint=sender.endpoint,
        lease=lease.lease_id if lease is not None else b"",
        num_blocks=len(lease.blocks) if lease is not None else 0,
        expires_in_s=lease_s,
    )


def kv_transfer_stats(
    kv_sender: KVSender | None,
    kv_tiers: KVTiers | None,
    kv_plane: KVPlaneServer | None,
    plane_link: PlaneLink | None,
) -> dict[str, Any]:
    """The transfer's counters, as ``LLMEngine.stats`` reports them."""
    s: dict[str, Any] = {}
    if kv_sender is not None:
        s.update({f"kv_send_{k}": v for k, v in kv_sender.stats.items()})
        leases = kv_sender.leases
        s.update({f"kv_leases_{k}": v for k, v in leases.stats.items()})
    if kv_tiers is not None and kv_tiers.remote is not None:
        s.update({f"kv_pull_{k}": v for k, v in kv_tiers.remote.stats.items()})
    if kv_plane is not None:  # the transfer plane's server and link (ZeroMQ)
        s.update({f"kv_plane_{k}": v for k, v in kv_plane.stats.items()})
    if plane_link is not None:
        s.update({f"kv_link_{k}": v for k, v in plane_link.stats.items()})
    return s
