"""The replay socket: replay and snapshot requests, their deadlines, their replies.

A mixin of :class:`~.subscriber.ZmqEventSubscriber`, split out so the conversation with a
publisher's ROUTER socket (a DEALER per replica; ``[b"", start_seq]`` out, one message per
batch and an end marker back; ``start_seq = -2`` for a snapshot) reads apart from the live
stream. A request unanswered by its deadline is sent again, up to ``max_attempts``, then
the replica's state is given up (:class:`~.subscriber_recovery.GapRecovery`).
"""

from __future__ import annotations

import logging
import time
from typing import Literal

import zmq

from ..framing import SNAPSHOT_REQUEST, pack_seq, unpack_seq
from .subscription import Subscription

log = logging.getLogger(__name__)


class ReplayClient:
    """Replay and snapshot requests and what their replies deliver; the attributes and the
    methods it calls are :class:`~.subscriber.ZmqEventSubscriber`'s."""

    def _request(self, r: Subscription, kind: Literal["replay", "snapshot"], start: int) -> None:
        if r.dealer is None:
            r.dealer = self._ctx.socket(zmq.DEALER)
            r.dealer.setsockopt(zmq.LINGER, 0)
            r.dealer.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
            r.dealer.connect(r.replay_endpoint)
            self._watch(r.dealer.getsockopt(zmq.FD), lambda: self._read_reply(r))
        if kind == "replay":
            r.stats.replays += 1
        else:
            r.stats.snapshots += 1
        r.syncing = kind
        r.reply = []
        r.deadline = time.monotonic() + self.request_timeout
        r.dealer.send_multipart((b"", pack_seq(start)))
        self._look_again(r.dealer, lambda: self._read_reply(r))  # the send may take the edge
        if self._loop is not None:  # the thread looks after every wake-up
            self._loop.call_later(self.request_timeout + 0.001, self._on_deadline)

    def _on_deadline(self) -> None:
        if self._running:
            self._check_deadlines()

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for r in list(self._replicas.values()):
            if r.syncing and now >= r.deadline:
                r.stats.request_timeouts += 1
                kind = r.syncing
                self._cancel_request(r)
                r.attempts += 1
                if r.attempts >= self.max_attempts:
                    log.warning(
                        "replica %s: no answer on %s, dropping its state",
                        r.replica_id,
                        r.replay_endpoint,
                    )
                    self._give_up(r)
                else:
                    start = SNAPSHOT_REQUEST if kind == "snapshot" else r.last_seq + 1
                    self._request(r, kind, start)

    def _read_reply(self, r: Subscription) -> None:
        while r.dealer is not None:
            try:
                frames = r.dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            # [b"", topic, seq, payload] (kvroute) or [b"", seq, payload] (vLLM)
            if len(frames) == 4:
                seq_raw, payload = frames[2], frames[3]
            elif len(frames) == 3:
                seq_raw, payload = frames[1], frames[2]
            else:
                self._malformed(r, f"replay reply of {len(frames)} frames")
                continue
            try:
                seq = unpack_seq(seq_raw)
            except ValueError as e:
                self._malformed(r, str(e))
                continue
            if payload == b"":  # end marker
                self._finish_reply(r)
                return
            r.reply.append((seq, payload))

    def _finish_reply(self, r: Subscription) -> None:
        kind, reply = r.syncing, r.reply
        r.syncing, r.reply, r.attempts = "", [], 0
        if kind == "snapshot":
            self._apply_snapshot(r, reply)
        else:
            self._apply_replay(r, reply)

    def _apply_snapshot(self, r: Subscription, reply: list[tuple[int, bytes]]) -> None:
        if not reply:
            # The publisher keeps no snapshots (vLLM): rebuild from its replay buffer.
            r.snapshot_supported = False
            self._resync(r)
            return
        batches = [self._decode(r, payload) for _, payload in reply]
        if any(b is None for b in batches) or len({s for s, _ in reply}) != 1:
            self._give_up(r)
            return
        seq = reply[0][0]
        for b in batches:
            self._deliver(r, seq, b, "snapshot")  # type: ignore[arg-type]
        r.last_seq = seq
        self._drain_pending(r)

    def _apply_replay(self, r: Subscription, reply: list[tuple[int, bytes]]) -> None:
        before = r.last_seq
        first_seq = next((seq for seq, _ in reply if seq > r.last_seq), None)
        if first_seq is not None and first_seq > r.last_seq + 1 and not r.snapshot_supported:
            # The buffer no longer reaches back and there is no snapshot to ask for: what
            # the hole changed is unknowable, so restart the view at the buffer's start.
            if r.last_seq >= 0 or r.stats.delivered:
                self._reset(r)
            r.last_seq = first_seq - 1
        for seq, payload in reply:
            if seq <= r.last_seq:
                continue
            batch = self._decode(r, payload) if seq == r.last_seq + 1 else None
            if batch is None:
                break  # the replay does not reach back far enough, or holds garbage
            self._deliver(r, seq, batch, "replay")
        first = next(((seq, b) for seq, b in r.pending if seq > r.last_seq), None)
        if first is not None and (first[0] != r.last_seq + 1 or first[1] is None):
            newest = max((seq for seq, _ in reply), default=-1)
            if r.last_seq == newest > before:
                # A newer hole, lost after the buffer was read (batches kept arriving while
                # the reply was on its way): the next replay holds it.
                r.stats.gaps += 1
                self._request(r, "replay", r.last_seq + 1)
                return
            # Still a hole: the engine's buffer no longer holds it.
            if r.snapshot_supported:
                self._request(r, "snapshot", SNAPSHOT_REQUEST)
            else:
                self._give_up(r)
            return
        self._drain_pending(r)
