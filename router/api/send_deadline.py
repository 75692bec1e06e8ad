"""A deadline on every piece of a response: a client that stops reading is dropped.

Why: a streaming client that stops reading (a stuck proxy, a paused process) fills the
socket's buffers, and then the front door waits in ``send`` for as long as the client likes,
holding the request's in-flight slot (its tenant's share) and the tokens the replica keeps
producing. With this middleware a send that does not complete within ``timeout_s`` ends
the response; uvicorn closes a connection whose response did not complete, the stream is
closed and its slot released. A client that reads slowly but steadily never trips it: the
clock runs per send, not per response (nginx's ``send_timeout`` works the same way).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

SEND_TIMEOUT_S = 60.0


class ClientTooSlowError(Exception):
    """The client did not take a piece of its response within the deadline."""


class SendDeadlineMiddleware:
    """Bounds each send of a response by ``timeout_s`` (None: no bound)."""

    def __init__(
        self, app: ASGIApp, timeout_s: float | None, on_drop: Callable[[], Any] | None = None
    ) -> None:
        self.app = app
        self.timeout_s = timeout_s
        self.on_drop = on_drop

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        timeout = self.timeout_s
        if scope["type"] != "http" or timeout is None:
            await self.app(scope, receive, send)
            return

        async def send_within_deadline(message: Message) -> None:
            try:  # the start too: a kept-alive client may have stopped reading already
                async with asyncio.timeout(timeout):  # no task per send, as wait_for makes
                    await send(message)
            except TimeoutError:
                raise ClientTooSlowError from None

        try:
            await self.app(scope, receive, send_within_deadline)
        except ClientTooSlowError:
            rid = scope.get("state", {}).get("request_id", "?")
            log.warning("request %s: the client took nothing for %g s; dropped", rid, timeout)
            if self.on_drop is not None:
                self.on_drop()
