"""A request's class at the door: its priority and its TTFT deadline.

Why here and not in intake: both come from three places that must agree before anything
is routed -- the tenant's configuration (its default ``priority`` and the most urgent
``min_priority`` it may ask for: :mod:`..fleet.tenants`), the body's ``priority`` (vLLM's
field: an int, lower runs first) and headers (an operator-mapped priority header,
``--priority-header``; a TTFT deadline, ``x-kvroute-slo-ttft-ms`` or llm-d's
``x-llm-d-slo-ttft-ms``) -- and every disagreement is the client's 400, said before the
request costs a replica anything.

Precedence: the operator's header, else the body, else the tenant's default. A value more
urgent than the tenant may ask for is refused, not clamped: a silent downgrade would look
like a slow fleet.
"""

from __future__ import annotations

import math
import time
from typing import Any

import msgspec
from starlette.types import Scope

from ..fleet.tenants import PRIORITY_MAX, PRIORITY_MIN, Tenant
from .errors import APIError, header, one_line

SLO_HEADERS = (b"x-kvroute-slo-ttft-ms", b"x-llm-d-slo-ttft-ms")
MAX_SLO_MS = 24 * 3600 * 1000.0


class DoorHints(msgspec.Struct, frozen=True):
    """What a request's headers say of its class, read before the body (raw values)."""

    priority: str | None = None  # the operator's priority header, as sent
    priority_header: str = ""  # its name (for the error)
    slo_ttft_ms: str | None = None  # the deadline header, as sent
    slo_header: str = ""
    arrival: float = 0.0  # monotonic seconds when the headers were read


class RequestClass(msgspec.Struct, frozen=True):
    """A request's priority and the monotonic time its first token is due (None: none)."""

    priority: int = 0
    deadline: float | None = None


def read_hints(scope: Scope, priority_header: str | None) -> DoorHints:
    """The class headers of a request (cheap: no header list is built)."""
    prio = header(scope, priority_header.lower().encode()) if priority_header else None
    slo, slo_name = None, ""
    for name in SLO_HEADERS:
        slo = header(scope, name)
        if slo is not None:
            slo_name = name.decode()
            break
    return DoorHints(prio, priority_header or "", slo, slo_name, time.monotonic())


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, "invalid_request_error", param, "invalid_priority")


def classify(body_priority: Any, hints: DoorHints | None, tenant: Tenant) -> RequestClass:
    """The request's class; an :class:`APIError` 400 for a value that is not an int in
    range, a priority more urgent than ``tenant`` may ask for, or a bad deadline."""
    priority = tenant.priority
    param = "priority"
    if body_priority is not None:
        priority = body_priority  # the body's schema checked its type and range
    if hints is not None and hints.priority is not None:
        param = hints.priority_header
        raw = hints.priority.strip()
        try:
            priority = int(raw)
        except ValueError:
            raise _bad(
                f"`{param}` must be an integer, got {one_line(raw)[:40]!r}.", param
            ) from None
        if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
            raise _bad(f"`{param}` must be a 32-bit integer.", param)
    if priority < tenant.min_priority:
        raise _bad(
            f"priority {priority} is more urgent than this tenant may ask for (at least "
            f"{tenant.min_priority}; lower runs first).",
            param,
        )
    deadline = None
    if hints is not None and hints.slo_ttft_ms is not None:
        raw = hints.slo_ttft_ms.strip()
        try:
            ms = float(raw)
        except ValueError:
            ms = math.nan
        if not 0 < ms <= MAX_SLO_MS:  # nan, inf, zero and negatives fail here too
            raise _bad(
                f"`{hints.slo_header}` must be a positive number of milliseconds, got "
                f"{one_line(raw)[:40]!r}.",
                hints.slo_header,
            )
        deadline = hints.arrival + ms / 1000.0
    return RequestClass(priority, deadline)
