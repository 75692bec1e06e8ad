"""Prefix fetch: a request placed on one replica pulls its prefix from another one's cache.

Without it a hot prefix can be used only where it lives, so the policy has two choices for
a request whose prefix a busy replica holds: queue behind the holder, or recompute the
prefix elsewhere. A fetch is the third: replica ``r`` takes the request and pulls the
blocks it lacks from the holder ``h`` over the transfer plane (a pull that names blocks by
hash, pinned at ``h`` for the pull's length: :mod:`kvroute.replica.kv_transfer.leases`).
Priced in ``r``'s own seconds beside its recompute (:meth:`~.policy.KVPolicy.choose`)::

    fetch_s = m * bs * kv_bytes_per_token / link_r + FETCH_RTT_S
    m       = h's device blocks - r's own (device and lower tiers), h the fetchable
              replica other than r holding the most of the prompt on its device
    link_r  = r's measured pull bandwidth (LoadReport.kv_link_bytes_per_s), or
              DEFAULT_LINK_BYTES_PER_S until it has pulled

The fetched tokens then count as cached for its prefill and its compute (``work``), and as
new blocks for eviction and capacity (they take blocks on ``r``, as a miss would). ``r``
fetches only where that is cheaper than computing them: a slow link, or a device that
prefills faster than the link carries KV, keeps the recompute (an 8B model on an H100
prefills a token in about 20 us; its 128 KiB of KV take 128 us at 1 GB/s, 5 us at 25).
So hot prefixes replicate on demand instead of piling onto their holder, where the link
makes that cheaper than the holder's queue; nothing is thresholded.

Not priced: the holder's part (a copy out of its device off its step, and its plane
thread's sends), small beside the prefill it spares and paid by a replica whose queue the
request avoids; and the index's view of the holder, which may be stale (a block evicted
since its event): the pull then brings what is still there and the rest is computed.
"""

from __future__ import annotations

from collections.abc import Callable

from .load import LoadTracker

# A link whose speed the replica has not measured yet: 1 GB/s, loopback TCP's floor on the
# 2-vCPU VM (benchmarks/bench_kv_transfer.py); never free.
DEFAULT_LINK_BYTES_PER_S = 1e9
# The pull's round trip and the holder's pin (its engine's next poll), once per request.
FETCH_RTT_S = 2e-3


class Holders:
    """For one request: the two fetchable replicas holding the most of its prefix on their
    device, so that each replica's best other holder is found in O(1)."""

    __slots__ = ("first", "second")

    def __init__(self, matched: dict[str, int], fetchable: Callable[[str], object]) -> None:
        self.first: tuple[int, str] = (0, "")
        self.second: tuple[int, str] = (0, "")
        for r, blocks in matched.items():
            if blocks <= self.second[0] or not fetchable(r):
                continue
            if blocks > self.first[0]:
                self.first, self.second = (blocks, r), self.first
            else:
                self.second = (blocks, r)

    def best_for(self, r: str) -> tuple[int, str]:
        """(blocks, holder): the most any fetchable replica but ``r`` holds; (0, "")."""
        return self.second if self.first[1] == r else self.first


def link_bytes_per_s(load: LoadTracker, r: str) -> float:
    """``r``'s measured pull bandwidth, else the default."""
    report = load.last_report(r)
    link = report.kv_link_bytes_per_s if report is not None else 0.0
    return link if link > 0 else DEFAULT_LINK_BYTES_PER_S
