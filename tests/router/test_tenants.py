"""The tenants file and the limits it sets: parsing and checks, key hashes, admin keys,
and the per-tenant buckets and shares on a clock the test moves."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvroute.router.limits import Limits, OverloadedError, RateLimits, TenantShares, TokenBucket
from kvroute.router.tenants import (
    AuthError,
    Tenants,
    hash_key,
    load_tenants,
    tenant_salt,
    tenants_from_api_keys,
)

KEY_K = f'keys = ["{hash_key("k")}"]\n'
EXAMPLE = Path(__file__).parents[2] / "deploy" / "tenants.example.toml"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_the_shipped_example_file_loads_and_its_keys_authenticate() -> None:
    spec = load_tenants(EXAMPLE)
    assert [t.id for t in spec.tenants] == ["acme", "globex"]
    acme = spec.tenants[0].limits
    assert acme == Limits(requests_per_minute=600, tokens_per_minute=2_000_000, max_concurrent=64)
    tenants = Tenants(spec, "secret")
    for key, tid in (
        ("kvr-example-acme", "acme"),
        ("kvr-example-acme-2", "acme"),
        ("kvr-example-globex", "globex"),
    ):
        t = tenants.authenticate(f"Bearer {key}")
        assert t.tenant_id == tid and t.cache_salt == tenant_salt("secret", tid)
    assert tenants.authenticate("Bearer kvr-example-globex").limits.requests_per_minute == 60
    assert tenants.is_admin("Bearer kvr-example-admin")
    assert not tenants.is_admin("Bearer kvr-example-acme")
    for bad in (None, "Bearer nope", "Basic kvr-example-admin", "Bearer "):
        with pytest.raises(AuthError):
            tenants.is_admin(bad)
    with pytest.raises(AuthError):  # an admin key is not a tenant
        tenants.authenticate("Bearer kvr-example-admin")
    assert not tenants.open


def test_keys_are_stored_as_hashes_only() -> None:
    digest = hash_key("kvr-secret")
    assert digest.startswith("sha256:") and len(digest) == 71 and "kvr-secret" not in digest
    spec = tenants_from_api_keys({"k1": "t1", "k2": "t1", "k3": "t2"})
    assert [(t.id, len(t.keys)) for t in spec.tenants] == [("t1", 2), ("t2", 1)]
    assert all(k.startswith("sha256:") for t in spec.tenants for k in t.keys)
    assert Tenants(spec, "s").authenticate("Bearer k2").tenant_id == "t1"


def test_without_tenants_everyone_is_the_anonymous_tenant() -> None:
    tenants = Tenants(None, "s")
    assert tenants.open and tenants.authenticate(None).tenant_id == "default"
    assert tenants.is_admin(None)  # nothing to protect /fleet with


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ('[[tenants]]\nid = "a"\nkeys = ["plain-key"]\n', "sha256:<64 hex"),
        ('[[tenants]]\nid = "a"\nkeys = []\n', "at least one key"),
        (f'[[tenants]]\nid = "a"\nkeys = ["{hash_key("k")}"]\n' * 2, "unique"),
        (
            f'[[tenants]]\nid = "a"\nkeys = ["{hash_key("k")}"]\n'
            f'[[tenants]]\nid = "b"\nkeys = ["{hash_key("k")}"]\n',
            "appears twice",
        ),
        (f'[[tenants]]\nid = "a"\nkeys = ["{hash_key("k")}"]\nrpm = 5\n', "unknown field"),
        (
            f'[[tenants]]\nid = "a"\nkeys = ["{hash_key("k")}"]\nrequests_per_minute = 0\n',
            ">= 1",
        ),
        (
            f'admin_keys = ["{hash_key("k")}"]\n[[tenants]]\nid = "a"\n{KEY_K}',
            "also a tenant",
        ),
        ("[[tenants]\n", "line 1"),  # not TOML
        ('tenants = "x"\n', "Expected `array`"),
    ],
)
def test_a_bad_tenants_file_says_what_is_wrong(tmp_path: Path, text: str, why: str) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"tenants\.toml") as info:
        load_tenants(path)
    assert why in str(info.value)


def test_requests_per_minute_is_a_bucket_of_one_minutes_worth() -> None:
    clock = Clock()
    rates, limits = RateLimits(clock), Limits(requests_per_minute=3)
    for _ in range(3):  # a burst up to the minute's allowance
        rates.admit("t", limits, 10)
    with pytest.raises(OverloadedError, match="3 requests per minute") as info:
        rates.admit("t", limits, 10)
    assert info.value.retry_after_s == pytest.approx(20.0)  # one request's worth
    assert info.value.retry_after == "20"
    rates.admit("other", limits, 10)  # another tenant has its own bucket
    clock.t += 19.9
    with pytest.raises(OverloadedError):
        rates.admit("t", limits, 10)
    clock.t += 0.1
    rates.admit("t", limits, 10)
    clock.t += 3600  # refilled, never beyond one minute's worth
    for _ in range(3):
        rates.admit("t", limits, 10)
    with pytest.raises(OverloadedError):
        rates.admit("t", limits, 10)


def test_tokens_per_minute_charges_prompts_at_once_and_outputs_at_the_end() -> None:
    clock = Clock()
    rates, limits = RateLimits(clock), Limits(tokens_per_minute=120)  # 2 tokens a second
    rates.admit("t", limits, 100)  # 20 left
    rates.admit("t", limits, 100)  # admitted while positive: 80 in debt
    with pytest.raises(OverloadedError, match="120 tokens per minute") as info:
        rates.admit("t", limits, 1)
    assert info.value.retry_after_s == pytest.approx(40.0, abs=1e-6)
    clock.t += 41
    rates.admit("t", limits, 0)  # 2 left
    rates.charge("t", 50)  # its output: 48 in debt
    with pytest.raises(OverloadedError) as info:
        rates.admit("t", limits, 0)
    assert info.value.retry_after_s == pytest.approx(24.0, abs=1e-6)
    rates.charge("untracked", 10**6)  # a tenant without a token limit: nothing to charge


def test_a_refused_request_takes_nothing() -> None:
    clock = Clock()
    rates = RateLimits(clock)
    both = Limits(requests_per_minute=60, tokens_per_minute=60)
    rates.admit("t", both, 61)  # tokens: -1; requests: 59 left
    for _ in range(5):
        with pytest.raises(OverloadedError, match="tokens per minute"):
            rates.admit("t", both, 1)
    clock.t += 2  # tokens back to +1; requests refilled to the cap (the refusals took none)
    rates.admit("t", both, 0)
    assert rates._requests["t"].level == pytest.approx(59.0)  # 54 had they taken requests
    assert rates._tokens["t"].level == pytest.approx(1.0)


def test_bucket_never_banks_more_than_a_minute() -> None:
    b = TokenBucket(60, now=0.0)
    b.level = 0.0
    b.refill(10_000.0)
    assert b.level == 60.0 and b.wait_s(60.0, 10_000.0) == 0.0 and b.wait_s(61.0, 10_000.0) == 1.0


def test_a_tenants_own_concurrency_limit_replaces_the_default_cap() -> None:
    shares = TenantShares(cap=2)
    own = Limits(max_concurrent=3)
    assert [shares.admit("a") for _ in range(3)] == [True, True, False]
    assert [shares.admit("b", own) for _ in range(4)] == [True, True, True, False]
    shares.release("a")
    assert shares.admit("a") and shares.in_flight("a") == 2 and shares.in_flight("b") == 3
    with pytest.raises(ValueError):
        Limits(max_concurrent=0)
