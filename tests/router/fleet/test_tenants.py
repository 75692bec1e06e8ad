"""The tenants file: parsing and checks, keys stored as hashes, admin keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvroute.router.fleet.tenants import (
    DEV_FLEET_SECRET,
    AuthError,
    Limits,
    Tenants,
    TenantsFile,
    hash_key,
    load_api_keys,
    load_tenants,
    resolve_fleet_secret,
    tenant_salt,
    tenants_from_api_keys,
)

KEY_K = f'keys = ["{hash_key("k")}"]\n'
EXAMPLE = Path(__file__).parents[3] / "deploy" / "tenants.example.toml"


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
    with pytest.raises(AuthError, match="admin key reads /fleet only"):  # not a tenant's
        tenants.authenticate("Bearer kvr-example-admin")
    with pytest.raises(AuthError, match="incorrect API key"):
        tenants.authenticate("Bearer nope")
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


def test_a_tenants_file_grants_adapters_by_name_or_all(tmp_path: Path) -> None:
    """``adapters = [...]`` grants those, ``["*"]`` every one, none listed: the base only;
    the anonymous tenant of a server without keys, and flat key files, may use all."""
    path = tmp_path / "t.toml"
    path.write_text(
        f'[[tenants]]\nid = "a"\nkeys = ["{hash_key("ka")}"]\nadapters = ["x", "y"]\n'
        f'[[tenants]]\nid = "b"\nkeys = ["{hash_key("kb")}"]\n'
        f'[[tenants]]\nid = "c"\nkeys = ["{hash_key("kc")}"]\nadapters = ["*"]\n'
    )
    tenants = Tenants(load_tenants(path), "s")
    a, b, c = (tenants.authenticate(f"Bearer {k}") for k in ("ka", "kb", "kc"))
    assert [a.may_use(n) for n in ("x", "y", "z")] == [True, True, False]
    assert not b.may_use("x") and c.may_use("x") and c.may_use("anything")
    assert Tenants(None, "s").authenticate(None).may_use("x")
    assert Tenants(tenants_from_api_keys({"k": "t"}), "s").authenticate("Bearer k").may_use("x")
    path.write_text(f'[[tenants]]\nid = "a"\nkeys = ["{hash_key("ka")}"]\nadapters = [""]\n')
    with pytest.raises(ValueError, match="adapters"):
        load_tenants(path)


@pytest.mark.parametrize(
    ("text", "name"),
    [
        ('[[tenants]]\nid = "a\\u0000b"\n' + KEY_K, "tenant id"),
        ('[[tenants]]\nid = "a\\nb"\n' + KEY_K, "tenant id"),
        ('[[tenants]]\nid = "a"\n' + KEY_K + 'adapters = ["x\\u001b[2J"]\n', "adapter name"),
    ],
    ids=["nul-id", "newline-id", "esc-adapter"],
)
def test_a_name_with_a_control_character_is_refused(tmp_path: Path, text: str, name: str) -> None:
    """Tenant ids and adapter names become /metrics labels and log words: the exposition
    format cannot escape a NUL, and an ESC in a log hides what follows."""
    path = tmp_path / "tenants.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"tenants\.toml: tenants\[0\]: {name} .*control") as info:
        load_tenants(path)
    assert "\x00" not in str(info.value) and "\x1b" not in str(info.value)
    keys = tmp_path / "keys"
    for body in ('{"k": "t\\u0000"}', "k:t\x07x\n"):
        keys.write_text(body)
        with pytest.raises(ValueError, match=r"tenant id .*control character"):
            load_api_keys(keys)


def test_metrics_need_an_admin_or_the_metrics_key_once_any_key_is_set() -> None:
    spec = tenants_from_api_keys({"key-a": "alpha"})
    spec = TenantsFile(spec.tenants, admin_keys=[hash_key("key-admin")])
    keyed = Tenants(spec, "s", metrics_key="key-m")
    assert keyed.may_scrape("Bearer key-m") and keyed.may_scrape("Bearer key-admin")
    assert not keyed.may_scrape("Bearer key-a")  # a tenant: 403
    for bad in (None, "Bearer nope", "Basic key-m"):
        with pytest.raises(AuthError):
            keyed.may_scrape(bad)
    assert not keyed.is_admin("Bearer key-m")  # /fleet: 403, not 401
    with pytest.raises(AuthError, match="/metrics only"):
        keyed.authenticate("Bearer key-m")
    assert Tenants(None, "s").may_scrape(None)  # nothing configured: open, as before
    only_metrics = Tenants(None, "s", metrics_key="key-m")
    assert only_metrics.may_scrape("Bearer key-m") and only_metrics.authenticate(None)
    with pytest.raises(AuthError):
        only_metrics.may_scrape(None)
    with pytest.raises(ValueError, match="also a tenant's key"):
        Tenants(spec, "s", metrics_key="key-a")


def test_the_fleet_secret_comes_from_the_flag_then_kvroute_fleet_secret(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``--fleet-secret``, else ``$KVROUTE_FLEET_SECRET`` (read at router start), else the
    development value, warned about."""
    monkeypatch.setenv("KVROUTE_FLEET_SECRET", "from-env")
    assert resolve_fleet_secret("from-flag") == "from-flag"
    assert resolve_fleet_secret(None) == "from-env"
    monkeypatch.delenv("KVROUTE_FLEET_SECRET")
    with caplog.at_level("WARNING"):
        dev = resolve_fleet_secret(None)
    assert dev == DEV_FLEET_SECRET and "no fleet secret" in caplog.text
