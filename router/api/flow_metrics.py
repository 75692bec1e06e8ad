"""/metrics of flow control (:mod:`..fleet.flow`): the queue per priority band.

Why a module of its own: the queue lives in ``fleet/`` and keeps plain counts; the series
are named and shaped here, beside :mod:`.metrics`, whose families it reuses. The wait
histogram is observed as requests leave the queue; the rest is read at scrape time.

Series (``band`` is the priority, vLLM's meaning; past ``MAX_BAND_LABELS`` distinct
bands the rest share ``other``):

- ``kvroute:flow_queue_length{band}``: requests waiting at the door now;
- ``kvroute:flow_queue_wait_seconds{band}``: how long each dispatched request waited;
- ``kvroute:flow_dispatches_total{band}``: requests sent on to a replica;
- ``kvroute:flow_shed_total{band,cause}``: requests refused with 429, ``cause``
  ``queue_full`` or ``deadline``;
- ``kvroute:flow_replica_unstarted{replica}``: this front door's requests on a replica
  without a first token yet (what room is measured by).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .metrics import PREFIX, TTFT_BUCKETS, Metrics, _Family

if TYPE_CHECKING:
    from ..fleet.flow import FlowControl

MAX_BAND_LABELS = 32
_seen_bands: set[int] = set()


def band(priority: int) -> str:
    """The label of a band (bounded in number)."""
    if priority in _seen_bands or len(_seen_bands) < MAX_BAND_LABELS:
        _seen_bands.add(priority)
        return str(priority)
    return "other"


def observe_wait(family: _Family, priority: int, seconds: float) -> None:
    """One dispatch's wait at the door, under its band's label (flow control's
    ``on_wait``, with ``family`` bound: the door calls it, nothing calls back)."""
    family.labels(band(priority)).observe(seconds)


def flow_wait_family(metrics: Metrics) -> _Family:
    """The wait histogram, listed among ``metrics``' own series."""
    family = _Family(
        PREFIX + "flow_queue_wait_seconds",
        "Time a request waited at the front door for a replica with room, per priority band.",
        ["band"],
        TTFT_BUCKETS,
    )
    metrics._families.append(family)
    return family


class FlowCollector(Collector):
    """The queue's state and counts, read at scrape time."""

    def __init__(self, flow: FlowControl) -> None:
        self.flow = flow

    def collect(self) -> Iterator[Metric]:
        flow = self.flow
        length = GaugeMetricFamily(
            PREFIX + "flow_queue_length",
            "Requests waiting at the front door for a replica with room, per priority band.",
            labels=["band"],
        )
        for b, n in sorted(flow.lengths().items()):
            length.add_metric([band(b)], n)
        yield length
        sent = CounterMetricFamily(
            PREFIX + "flow_dispatches",
            "Requests flow control sent on to a replica, per priority band.",
            labels=["band"],
        )
        for b, n in sorted(flow.stats.dispatched.items()):
            sent.add_metric([band(b)], n)
        yield sent
        shed = CounterMetricFamily(
            PREFIX + "flow_shed",
            "Requests flow control refused (429), per band and cause (queue_full, deadline).",
            labels=["band", "cause"],
        )
        for (b, cause), n in sorted(flow.stats.shed.items()):
            shed.add_metric([band(b), cause], n)
        yield shed
        unstarted = GaugeMetricFamily(
            PREFIX + "flow_replica_unstarted",
            "This front door's requests on a replica without a first token yet.",
            labels=["replica"],
        )
        for rid, n in sorted(flow.unstarted.items()):
            unstarted.add_metric([rid], n)
        yield unstarted
