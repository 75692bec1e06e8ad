"""The publisher's replay socket: its frames as designed, the 8-byte sequence frame, and
garbage sent to it counted and ignored."""

from __future__ import annotations

import random

import msgspec
import pytest
import zmq

from kvroute.events import BlockStored, EventBatch
from kvroute.events.framing import pack_seq, unpack_seq

from ...waiting import poll
from .streams import BS, publisher

pytestmark = pytest.mark.usefixtures("where")  # conftest.py: every test on a thread and on a loop


def test_replay_protocol_frames_as_designed():
    """A bare DEALER speaking the documented protocol to a kvroute publisher."""
    pub = publisher(topic="r7", heartbeat_interval=None)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(pub.replay_endpoint)
    try:
        for i in range(5):
            pub.publish([BlockStored([bytes([i + 1]) * 16], None, [0] * BS, BS, None, "GPU", None)])
        pub.flush()
        dealer.send_multipart([b"", pack_seq(3)])
        replies = [dealer.recv_multipart() for _ in range(3)]
        assert [r[:3] for r in replies[:2]] == [
            [b"", b"r7", pack_seq(3)],
            [b"", b"r7", pack_seq(4)],
        ]
        assert msgspec.msgpack.decode(replies[0][3])[1][0]["block_hashes"] == [bytes([4]) * 16]
        assert replies[2] == [b"", b"", pack_seq(-1), b""]
        dealer.send_multipart([b"", pack_seq(-2)])  # snapshot
        snap = [dealer.recv_multipart() for _ in range(2)]
        assert snap[0][:3] == [b"", b"r7", pack_seq(4)]  # consistent with seq 4
        events = msgspec.msgpack.decode(snap[0][3])[1]
        assert events[0] == {"type": "AllBlocksCleared"}
        assert sorted(e["block_hashes"][0] for e in events[1:]) == [
            bytes([i + 1]) * 16 for i in range(5)
        ]
        assert snap[1] == [b"", b"", pack_seq(-1), b""]
    finally:
        dealer.close(0)
        pub.close()


def test_seq_frame_is_8_byte_big_endian_signed():
    assert pack_seq(1) == b"\x00" * 7 + b"\x01"
    assert unpack_seq(pack_seq(-1)) == -1
    with pytest.raises(ValueError):
        unpack_seq(b"\x00" * 4)


def test_garbage_sent_to_the_replay_socket_is_counted_and_ignored():
    """Random frames, a bad sequence frame and a negative start on the publisher's replay
    socket are counted and dropped; a proper replay request afterwards is answered whole."""
    rng = random.Random(7)
    with publisher() as pub:
        h = b"\x02" * 16
        pub.publish(EventBatch(0.0, [BlockStored([h], None, [0] * BS, BS, None, "GPU", None)]))
        assert pub.flush()
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
        try:
            garbage = [
                [b"junk"],  # no empty delimiter frame
                [b"", b"\x00" * 3],  # a sequence frame of the wrong size
                [b"", pack_seq(-7)],  # neither a sequence nor the snapshot request
                [b"", pack_seq(0), b"extra"],
                *([bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))]
                  for _ in range(20)),
            ]  # fmt: skip
            for frames in garbage:
                dealer.send_multipart(frames)
            dealer.send_multipart([b"", pack_seq(0)])
            assert dealer.poll(10_000), "no reply to a proper replay request"
            reply = [dealer.recv_multipart()]
            while unpack_seq(reply[-1][2]) != -1:  # up to the end marker
                assert dealer.poll(10_000)
                reply.append(dealer.recv_multipart())
            assert [unpack_seq(r[2]) for r in reply] == [0, -1]
            assert pub.malformed_requests == len(garbage)
            # Counted by the publisher's thread just after the end marker went out.
            assert poll(lambda: pub.replays_served == 1, timeout=20)
        finally:
            dealer.close(0)
