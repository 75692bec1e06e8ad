"""The `kvroute` command, run as a user runs it."""

from __future__ import annotations

import subprocess
import sys
import time

from kvroute.events import BlockHasher, BlockStored, ZmqEventPublisher

KVROUTE = [sys.executable, "-m", "kvroute.deploy.cli"]


def test_serve_says_clearly_that_it_is_not_built_yet():
    out = subprocess.run([*KVROUTE, "serve"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "not available yet" in out.stderr


def test_hash_prints_the_same_hashes_as_the_library():
    tokens = list(range(40))
    out = subprocess.run(
        [*KVROUTE, "hash", ",".join(map(str, tokens)), "--seed", "s", "--cache-salt", "t"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    expected = BlockHasher(seed="s").hash_blocks(tokens, cache_salt="t")
    assert out.stdout.split() == [x for i, h in enumerate(expected) for x in (str(i), h.hex())]


def test_events_follows_a_live_publisher():
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", heartbeat_interval=None)
    try:
        for i in range(3):
            pub.publish([BlockStored([bytes([i + 1]) * 16], None, [0] * 4, 4, None, "GPU", None)])
        proc = subprocess.Popen(
            [*KVROUTE, "events", pub.endpoint, "--replay", pub.replay_endpoint, "--count", "3"],
            stdout=subprocess.PIPE,
            text=True,
        )
        time.sleep(0.5)
        for i in range(3, 5):
            pub.publish([BlockStored([bytes([i + 1]) * 16], None, [0] * 4, 4, None, "GPU", None)])
        out, _ = proc.communicate(timeout=60)
        lines = out.splitlines()
        assert proc.returncode == 0 and len(lines) == 3
        assert "source=snapshot stored=3" in lines[0]  # what it joined too late for, at once
        assert "source=live stored=1" in lines[1] and "source=live stored=1" in lines[2]
    finally:
        pub.close()
