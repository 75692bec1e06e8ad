"""Event stream throughput over loopback, batch sizes 1 and 64 blocks, in one run.

    python benchmarks/bench_events.py [--seconds S]

Rows, per batch size:
- codec        encode + decode in one process, no sockets (the ceiling of the format);
- raw zmq      a child process sends pre-encoded batches on a bare PUB socket; the parent
               receives them with a bare SUB socket and does not decode (the transport ceiling);
- subscriber   the same pre-encoded stream, received by kvroute's ZmqEventSubscriber, which
               decodes, checks sequence numbers and delivers every batch to a callback
               (one core: the subscriber's thread);
- publisher    kvroute's ZmqEventPublisher in a child process (publish() + its thread's
               encode/send), received and decoded by kvroute's subscriber in the parent.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import threading
import time

import zmq

from kvroute.events import BlockStored, EventBatch, decode_batch, encode_batch
from kvroute.events.framing import pack_seq
from kvroute.events.transport import ReplicaBatch, ZmqEventPublisher, ZmqEventSubscriber

BS = 16


def make_batch(i: int, blocks: int) -> EventBatch:
    hashes = [(i * blocks + k).to_bytes(16, "big") for k in range(blocks)]
    return EventBatch(
        time.time(), [BlockStored(hashes, None, [7] * (blocks * BS), BS, None, "GPU", None)]
    )


def codec(blocks: int, seconds: float) -> float:
    payloads = [encode_batch(make_batch(i, blocks)) for i in range(256)]
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for i in range(256):
            decode_batch(payloads[i])
        n += 256
    dec = n / (time.perf_counter() - t0)
    batches = [make_batch(i, blocks) for i in range(256)]
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for b in batches:
            decode_batch(encode_batch(b))
        n += 256
    both = n / (time.perf_counter() - t0)
    return both * blocks, dec * blocks


def _raw_sender(endpoint_q, go, blocks: int, count: int) -> None:
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.bind("tcp://127.0.0.1:*")
    endpoint_q.put(pub.getsockopt_string(zmq.LAST_ENDPOINT))
    payloads = [encode_batch(make_batch(i, blocks)) for i in range(1024)]
    go.wait()
    for seq in range(count):
        pub.send_multipart((b"bench", pack_seq(seq), payloads[seq & 1023]))
    time.sleep(2)
    pub.close(linger=2000)


def _pub_sender(endpoint_q, go, blocks: int, count: int) -> None:
    pub = ZmqEventPublisher(
        "tcp://127.0.0.1:*",
        "tcp://127.0.0.1:*",
        topic="bench",
        heartbeat_interval=None,
        max_queue_size=count + 1,
    )
    endpoint_q.put((pub.endpoint, pub.replay_endpoint))
    batches = [make_batch(i, blocks) for i in range(1024)]
    go.wait()
    # Bursts of publish() calls, then the producer steps aside (as an engine does while its
    # model runs) so the publisher thread can encode and send.
    for start in range(0, count, 256):
        for i in range(start, min(start + 256, count)):
            pub.publish(batches[i & 1023])
        pub.flush(60)
    time.sleep(2)
    pub.close()


def run_raw(blocks: int, count: int) -> float:
    ctx = mp.get_context("spawn")
    q, go = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_raw_sender, args=(q, go, blocks, count))
    p.start()
    endpoint = q.get()
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    time.sleep(0.5)
    go.set()
    n = 0
    sub.recv_multipart()
    t0 = time.perf_counter()
    n = 1
    while n < count and sub.poll(3000):
        sub.recv_multipart()
        n += 1
    dt = time.perf_counter() - t0
    sub.close(0)
    p.join()
    return n * blocks / dt


def run_subscriber(blocks: int, count: int, kvroute_pub: bool) -> tuple[float, int, object]:
    ctx = mp.get_context("spawn")
    q, go = ctx.Queue(), ctx.Event()
    target = _pub_sender if kvroute_pub else _raw_sender
    p = ctx.Process(target=target, args=(q, go, blocks, count))
    p.start()
    got = q.get()
    endpoint, replay = got if kvroute_pub else (got, None)
    state = {"hashes": 0, "t0": 0.0, "t1": 0.0, "last": -1}
    done = threading.Event()

    def on_batch(item: ReplicaBatch) -> None:
        if item.source == "snapshot" or not item.batch.events:
            return
        if state["t0"] == 0.0:
            state["t0"] = time.perf_counter()
        for ev in item.batch.events:
            state["hashes"] += len(ev.block_hashes)
        state["t1"] = time.perf_counter()
        if item.seq >= count - 1:
            done.set()

    sub = ZmqEventSubscriber(on_batch, rcvhwm=0)
    sub.add_publisher("bench", endpoint, replay, "bench")
    time.sleep(0.5)
    go.set()
    done.wait(120)
    stats = sub.stats()["bench"]
    sub.close()
    p.join()
    dt = max(state["t1"] - state["t0"], 1e-9)
    return state["hashes"] / dt, state["hashes"], stats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--hashes", type=int, default=2_000_000, help="block hashes per run")
    args = ap.parse_args()
    print(
        f"# {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()},"
        f" pyzmq {zmq.__version__}, libzmq {zmq.zmq_version()}"
    )
    print(f"{'blocks/batch':>12} {'path':>11} {'block hashes/s':>15} {'batches/s':>11}  notes")
    for blocks in (1, 64):
        count = max(20_000, args.hashes // blocks) if blocks > 1 else 200_000
        both, dec = codec(blocks, args.seconds)
        print(
            f"{blocks:>12} {'codec':>11} {both:>15,.0f} {both / blocks:>11,.0f}  "
            f"encode+decode; decode alone {dec:,.0f} hashes/s"
        )
        raw = run_raw(blocks, count)
        print(
            f"{blocks:>12} {'raw zmq':>11} {raw:>15,.0f} {raw / blocks:>11,.0f}  "
            "recv only, no decode"
        )
        rate, n, st = run_subscriber(blocks, count, kvroute_pub=False)
        print(
            f"{blocks:>12} {'subscriber':>11} {rate:>15,.0f} {rate / blocks:>11,.0f}  "
            f"{n:,} hashes delivered; gaps={st.gaps} replays={st.replays} "
            f"snapshots={st.snapshots}"
        )
        rate, n, st = run_subscriber(blocks, count, kvroute_pub=True)
        print(
            f"{blocks:>12} {'publisher':>11} {rate:>15,.0f} {rate / blocks:>11,.0f}  "
            f"{n:,} hashes delivered; gaps={st.gaps} replays={st.replays} "
            f"snapshots={st.snapshots}"
        )


if __name__ == "__main__":
    main()
