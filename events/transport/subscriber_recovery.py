"""Gap recovery: what the subscriber does when a replica's stream is not in order.

A mixin of :class:`~.subscriber.ZmqEventSubscriber`, split out so the state machine its
docstring describes (a gap, a restart, a reconnect, a publisher that cannot answer) reads in
one place: the batches held back while a range is missing, the reset that drops a replica's
state (a synthetic ``AllBlocksCleared``), and giving up on a gap that cannot be filled. The
requests themselves go out through :class:`~.subscriber_replay.ReplayClient`.
"""

from __future__ import annotations

import logging
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from ..framing import SNAPSHOT_REQUEST
from ..wire import AllBlocksCleared, EventBatch
from .subscription import EVENTS, POLLIN, ReplicaBatch, Subscription

log = logging.getLogger(__name__)


class GapRecovery:
    """Restarts, reconnects, resets and gaps, per replica; the attributes and the methods it
    calls are :class:`~.subscriber.ZmqEventSubscriber`'s."""

    def _cancel_request(self, r: Subscription) -> None:
        """Forget an outstanding request; a fresh socket makes sure a late reply is never
        mistaken for the answer to a later request."""
        if r.dealer is not None:
            self._unwatch(r.dealer)
            r.dealer.close(linger=0)
            r.dealer = None
        r.syncing, r.reply = "", []

    def _restart(self, r: Subscription) -> None:
        r.stats.restarts += 1
        log.info("replica %s restarted (seq went back from %s)", r.replica_id, r.live_seq)
        self._cancel_request(r)
        r.pending = []
        self._reset(r)

    def _on_monitor(self, r: Subscription) -> None:
        """A reconnect may hide a restart: resynchronize from a snapshot to be sure."""
        while r.monitor is not None and r.monitor.getsockopt(EVENTS) & POLLIN:
            msg = recv_monitor_message(r.monitor, zmq.NOBLOCK)
            if msg["event"] == zmq.EVENT_DISCONNECTED:
                r.was_disconnected = True
            elif msg["event"] == zmq.EVENT_CONNECTED and r.was_disconnected:
                r.was_disconnected = False
                r.live_seq = None
                if r.replay_endpoint is not None:
                    self._cancel_request(r)
                    r.pending = []
                    if r.snapshot_supported:
                        self._request(r, "snapshot", SNAPSHOT_REQUEST)
                    else:
                        self._resync(r)

    def _resync(self, r: Subscription) -> None:
        """Rebuild a publisher without snapshots (vLLM) from its replay buffer: forget
        what is known and replay from seq 0 (the buffer's first batch if it rolled)."""
        if r.last_seq >= 0 or r.stats.delivered:
            self._reset(r)
        r.last_seq = -1
        self._request(r, "replay", 0)

    def _reset(self, r: Subscription) -> None:
        r.stats.resets += 1
        r.last_seq = -1
        cleared = EventBatch(time.time(), [AllBlocksCleared()])
        self._emit(r, ReplicaBatch(r.replica_id, -1, cleared, "reset"))

    def _recover(self, r: Subscription) -> None:
        """Fill the gap before ``r.pending``: replay if possible, else give up the state."""
        if r.replay_endpoint is None:
            self._give_up(r)
        else:
            self._request(r, "replay", r.last_seq + 1)

    def _give_up(self, r: Subscription) -> None:
        """No way to fill the gap: drop what we knew and follow the stream from here on.

        The view then lacks blocks stored before the hole -- that costs hits, never
        correctness: blocks we do show are ones the engine announced after the reset."""
        self._cancel_request(r)
        r.attempts = 0
        if r.last_seq >= 0 or r.stats.delivered:
            self._reset(r)
        r.pending = [(seq, b) for seq, b in r.pending if b is not None]
        if r.pending:
            r.last_seq = r.pending[0][0] - 1
        self._drain_pending(r)

    def _drain_pending(self, r: Subscription) -> None:
        pending, r.pending = r.pending, []
        for i, (seq, batch) in enumerate(pending):
            if seq <= r.last_seq:
                continue
            if seq == r.last_seq + 1 and batch is not None:
                self._deliver(r, seq, batch, "live")
                continue
            r.stats.gaps += 1
            r.pending = pending[i:]
            self._recover(r)
            return
