"""A request's class at the door (router/api/priority.py) and the tenants file's say in it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvroute.router.api.errors import APIError
from kvroute.router.api.priority import DoorHints, RequestClass, classify
from kvroute.router.fleet.tenants import Tenant, Tenants, hash_key, load_tenants

BATCH = Tenant("batch", "salt", priority=10, min_priority=5)


def test_the_tenants_default_then_the_body_then_the_operators_header() -> None:
    assert classify(None, None, BATCH) == RequestClass(10)
    assert classify(7, None, BATCH) == RequestClass(7)
    hints = DoorHints(priority=" 6 ", priority_header="x-priority")
    assert classify(7, hints, BATCH) == RequestClass(6)
    assert classify(None, None, Tenant("anon", "s")) == RequestClass(0)
    assert classify(-5, None, Tenant("anon", "s")).priority == -5  # the anonymous asks any


@pytest.mark.parametrize(
    ("body", "hints", "param"),
    [
        (4, None, "priority"),  # more urgent than the tenant may ask
        (None, DoorHints(priority="1", priority_header="x-priority"), "x-priority"),
        (None, DoorHints(priority="soon", priority_header="x-priority"), "x-priority"),
        (None, DoorHints(priority=str(2**40), priority_header="x-priority"), "x-priority"),
        (
            None,
            DoorHints(slo_ttft_ms="0", slo_header="x-kvroute-slo-ttft-ms"),
            "x-kvroute-slo-ttft-ms",
        ),
        (
            None,
            DoorHints(slo_ttft_ms="nan", slo_header="x-llm-d-slo-ttft-ms"),
            "x-llm-d-slo-ttft-ms",
        ),
        (
            None,
            DoorHints(slo_ttft_ms="inf", slo_header="x-llm-d-slo-ttft-ms"),
            "x-llm-d-slo-ttft-ms",
        ),
    ],
)
def test_what_is_refused_is_a_400_naming_it(
    body: object, hints: DoorHints | None, param: str
) -> None:
    with pytest.raises(APIError) as info:
        classify(body, hints, BATCH)
    assert info.value.status == 400 and info.value.param == param


def test_a_deadline_counts_from_arrival() -> None:
    hints = DoorHints(slo_ttft_ms="250", slo_header="x-kvroute-slo-ttft-ms", arrival=100.0)
    assert classify(None, hints, BATCH) == RequestClass(10, 100.25)


def test_the_tenants_file_sets_the_default_and_the_floor(tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    path.write_text(
        f'[[tenants]]\nid = "batch"\nkeys = ["{hash_key("k1")}"]\npriority = 10\n'
        f'min_priority = 5\n[[tenants]]\nid = "chat"\nkeys = ["{hash_key("k2")}"]\n'
    )
    tenants = Tenants(load_tenants(path), "secret")
    batch, chat = tenants.tenants["batch"], tenants.tenants["chat"]
    assert (batch.priority, batch.min_priority) == (10, 5)
    assert (chat.priority, chat.min_priority) == (0, 0)  # no floor given: its own default
    path.write_text(
        f'[[tenants]]\nid = "x"\nkeys = ["{hash_key("k1")}"]\npriority = 1\nmin_priority = 2\n'
    )
    with pytest.raises(ValueError, match="min_priority"):
        load_tenants(path)
