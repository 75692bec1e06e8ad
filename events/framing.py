"""The frames both ends of the event stream agree on (contract: pure data, no sockets).

Live (PUB):       [topic, seq (8-byte big-endian signed), payload]
Replay request:   DEALER sends [b"", start_seq (8-byte big-endian signed)]
Replay reply:     one [b"", topic, seq, payload] per buffered batch with seq >= start_seq,
                  then the end marker [b"", b"", -1, b""]. (vLLM's own publisher omits the
                  topic frame: [b"", seq, payload]; subscribers accept both.)
Snapshot request: start_seq = SNAPSHOT_REQUEST (-2). The reply is one or more batches, all
                  under the seq S the snapshot is consistent with, the first beginning with
                  AllBlocksCleared, then BlockStored events for every block held; then the
                  end marker. A publisher that knows no snapshots (vLLM) answers with the end
                  marker alone.
Heartbeat:        an empty batch under a fresh seq, sent when no batch went out for a while.

The sockets that send and read these frames are :mod:`kvroute.events.transport`.
"""

from __future__ import annotations

END_SEQ = -1
SNAPSHOT_REQUEST = -2


def pack_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def unpack_seq(raw: bytes) -> int:
    if len(raw) != 8:
        raise ValueError(f"sequence frame must be 8 bytes, got {len(raw)}")
    return int.from_bytes(raw, "big", signed=True)


# What a DEALER receives to end a reply: [b"", b"" (no topic), -1, b""].
END_MARKER = (b"", b"", pack_seq(END_SEQ), b"")
