"""An in-flight request's direct path keeps a stream's deltas in order and hands the end to
its reader."""

from __future__ import annotations

import asyncio

from kvroute.events.replica_api import GenerateDelta
from kvroute.router.fleet.replica_connection import InFlightRequest


def delta(*ids: int, finished: bool = False) -> GenerateDelta:
    return GenerateDelta(
        request_id="r",
        delta_token_ids=list(ids),
        delta_text="".join(chr(97 + i) for i in ids),
        finished=finished,
        finish_reason="length" if finished else None,
    )


def test_deltas_go_direct_only_while_the_reader_waits_with_nothing_unread():
    async def main() -> None:
        flight = InFlightRequest("r", 0)
        pushed: list[list[int]] = []
        accept = True

        def push(d: GenerateDelta) -> bool:
            if accept:
                pushed.append(d.delta_token_ids)
            return accept

        flight.push = push
        flight.put(delta(0))  # nobody waits yet: it waits for the reader
        assert pushed == [] and (await flight.next()).delta_token_ids == [0]

        reader = asyncio.ensure_future(flight.next())
        await asyncio.sleep(0)  # the reader waits now
        flight.put(delta(1))
        flight.put(delta(2))
        assert pushed == [[1], [2]] and not reader.done()

        accept = False  # the client stopped keeping up: this one goes to the reader ...
        flight.put(delta(3))
        accept = True
        flight.put(delta(4))  # ... and so does the next, merged behind it, never ahead
        assert pushed == [[1], [2]]
        assert (await reader).delta_token_ids == [3, 4]

        reader = asyncio.ensure_future(flight.next())
        await asyncio.sleep(0)
        flight.put(delta(5, finished=True))  # the end always goes to the reader
        last = await reader
        assert last.finished and last.delta_token_ids == [5] and pushed == [[1], [2]]

    asyncio.run(main())


def test_an_error_after_direct_deltas_reaches_the_reader():
    async def main() -> None:
        flight = InFlightRequest("r", 0)
        flight.push = lambda d: True
        reader = asyncio.ensure_future(flight.next())
        await asyncio.sleep(0)
        flight.put(delta(1))
        flight.fail(RuntimeError("replica lost"))
        try:
            await reader
        except RuntimeError as exc:
            assert "replica lost" in str(exc)
        else:
            raise AssertionError("the failure did not reach the reader")

    asyncio.run(main())
