"""The front door's uvicorn server (``deploy/http_server.py``'s :class:`IdleQuietServer`,
which ``kvroute router`` and ``kvroute serve`` run) wakes its loop once a second while idle,
not ten times, still dates its responses, and stops at once on a signal.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from typing import Any

import httpx

from kvroute.deploy.http_server import IdleQuietServer, uvicorn_config


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def test_the_idle_server_ticks_once_a_second_dates_replies_and_stops_on_a_signal() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = IdleQuietServer(uvicorn_config(app, loop="asyncio"))
    ticks: list[float] = []
    on_tick = server.on_tick

    async def counted(counter: int) -> bool:
        ticks.append(time.monotonic())
        return await on_tick(counter)

    server.on_tick = counted  # type: ignore[method-assign]

    async def main() -> float:
        task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient() as client:
            r = await client.get(f"http://127.0.0.1:{port}/")
        assert r.status_code == 200 and r.headers["date"].endswith("GMT")
        await asyncio.sleep(2.2)
        asked = time.monotonic()
        server.handle_exit(signal.SIGTERM, None)
        server._captured_signals.clear()  # else uvicorn raises it again as it returns
        await asyncio.wait_for(task, 5)
        return time.monotonic() - asked

    stopped_in = asyncio.run(main())
    assert 2 <= len(ticks) <= 5, len(ticks)  # once a second (uvicorn's own: ~23 in 2.2 s)
    assert stopped_in < 0.5, stopped_in  # the signal wakes it, no tick waited for
