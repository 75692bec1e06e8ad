"""A front door's connection to a replica keeps reading whatever one message or one request
does: a callback that raises fails its own request, never the connection.

The replica is a bare ROUTER socket speaking the data plane's frames (events/dataplane_wire.py),
so the test says exactly what arrives and in which order.
"""

from __future__ import annotations

import asyncio

import zmq

from kvroute.events import dataplane_wire as dp
from kvroute.events.load import LoadReport
from kvroute.events.replica_api import GenerateDelta, GenerateRequest, SamplingParams
from kvroute.router.fleet.replica_connection import ReplicaConnection


def request(rid: str) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid, prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=2)
    )


def load(running: int) -> LoadReport:
    return LoadReport(
        num_waiting=0, num_running=running, num_decoding=running, queued_prefill_tokens=0,
        decode_context_tokens=0, free_blocks=100, total_blocks=100,
    )  # fmt: skip


def delta(rid: str, tok: int, finished: bool = False) -> GenerateDelta:
    return GenerateDelta(
        request_id=rid,
        delta_token_ids=[tok],
        delta_text=chr(97 + tok),
        finished=finished,
        finish_reason="length" if finished else None,
    )


def test_a_failing_callback_fails_its_request_alone_and_reading_goes_on() -> None:
    async def main() -> None:
        ctx = zmq.Context.instance()
        replica = ctx.socket(zmq.ROUTER)
        port = replica.bind_to_random_port("tcp://127.0.0.1")
        loads: list[LoadReport] = []

        def on_load(rid: str, report: LoadReport) -> None:
            loads.append(report)
            if len(loads) == 1:
                raise RuntimeError("a bug in a load callback")

        conn = ReplicaConnection(
            "r0", f"tcp://127.0.0.1:{port}", "inc", "door", lambda *_: None, on_load=on_load
        )
        loop = asyncio.get_running_loop()

        async def recv() -> list[bytes]:
            return await loop.run_in_executor(None, replica.recv_multipart)

        try:
            peer, kind, _ = await recv()
            assert kind == dp.HELLO

            def send(kind: bytes, payload: object) -> None:
                replica.send_multipart([peer, kind, dp.encoder.encode(payload)])

            send(dp.HEARTBEAT, dp.Heartbeat("inc"))
            bad, good = conn.submit(request("bad")), conn.submit(request("good"))
            for _ in range(2):
                assert (await recv())[1] == dp.ADD
            reader = asyncio.ensure_future(bad.next())
            await asyncio.sleep(0)  # "bad" waits: its next delta goes to its push ...

            def push(d: GenerateDelta) -> bool:
                raise ValueError("this request's own failure")

            bad.push = push  # ... which raises
            send(dp.LOAD, load(1))  # its callback raises too
            send(dp.OUTPUTS, dp.StepOutputs([delta("bad", 0), delta("good", 0)]))
            send(dp.OUTPUTS, dp.StepOutputs([delta("good", 1, finished=True)]))
            send(dp.LOAD, load(0))

            try:
                await asyncio.wait_for(reader, 20)
                raise AssertionError("the failing request should have failed")
            except ValueError as exc:
                assert "own failure" in str(exc)
            first, last = await asyncio.wait_for(good.next(), 20), None
            if not first.finished:
                last = await asyncio.wait_for(good.next(), 20)
            ids = first.delta_token_ids + (last.delta_token_ids if last else [])
            assert ids == [0, 1]  # the other request, same batch and after, is whole
            frames = await asyncio.wait_for(recv(), 20)
            assert frames[1] == dp.ABORT and dp.decode_abort(frames[2]) == ["bad"]
            for _ in range(100):
                if len(loads) == 2:
                    break
                await asyncio.sleep(0.01)
            assert len(loads) == 2 and conn.callback_errors == 1  # counted, and read on
            assert conn.lost is None and not conn.flights
        finally:
            conn.close()
            replica.close(linger=0)

    asyncio.run(asyncio.wait_for(main(), 30))
