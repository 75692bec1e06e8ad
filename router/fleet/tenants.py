"""Tenants: API key -> tenant id -> tenant cache salt.

Why a derived salt and not the tenant id itself: the salt enters block 0 of every hash
chain (docs/architecture.md, "Block hashing"), and block hashes travel in clear over the
event stream; an HMAC of the tenant id under a fleet secret cannot be guessed or forged by
a client, so no request of another tenant can name (and hit) a tenant's blocks. A request's own
``cache_salt`` (vLLM's extension field) is appended to the tenant salt: it can split a
tenant's cache further, never reach into another tenant's.

Tenants come from a tenants file (``--tenants FILE``, TOML: ids, API keys stored as
SHA-256 hashes, optional limits, admin keys; see ``deploy/tenants.example.toml``) or, for
development, a flat key file. With neither, every request is the anonymous tenant
``default`` and no Authorization header is needed (as ``vllm serve`` without
``--api-key``); ``kvroute serve`` then listens on loopback only, unless told
``--allow-anonymous``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path

import msgspec

from .names import check_name

log = logging.getLogger(__name__)

FLEET_SECRET_ENV = "KVROUTE_FLEET_SECRET"
METRICS_KEY_ENV = "KVROUTE_METRICS_KEY"
DEV_FLEET_SECRET = "kvroute-dev-fleet-secret"  # a documented development value
DEFAULT_TENANT = "default"
# The priorities a request may carry (vLLM's meaning: lower runs first; a 32-bit int).
PRIORITY_MIN = -(2**31)
PRIORITY_MAX = 2**31 - 1


class Limits(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A tenant's limits (None: none of that kind)."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None

    def __post_init__(self) -> None:
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")


class AuthError(Exception):
    """The request names no tenant this router knows (HTTP 401)."""


ALL_ADAPTERS = "*"  # in a tenant's ``adapters``: every adapter the fleet serves


class Tenant(msgspec.Struct, frozen=True):
    tenant_id: str
    cache_salt: str  # hex HMAC-SHA256(fleet secret, tenant id)
    limits: Limits = Limits()
    # The LoRA adapters it may name in ``model``; None: every one (the anonymous tenant of
    # a server without keys, a tenant granted "*"). Others are, to it, models that do not
    # exist (router/lora/registry.py).
    adapters: frozenset[str] | None = frozenset()
    # Its requests' priority when they ask none, and the most urgent (lowest) they may ask
    # for (router/api/priority.py); the anonymous tenant may ask any.
    priority: int = 0
    min_priority: int = PRIORITY_MIN

    def may_use(self, adapter: str) -> bool:
        return self.adapters is None or adapter in self.adapters

    def salt_for(self, request_salt: str | None) -> str:
        """The salt a request's blocks are hashed with: the tenant's, then the request's."""
        return f"{self.cache_salt}:{request_salt}" if request_salt else self.cache_salt


def tenant_salt(fleet_secret: str, tenant_id: str) -> str:
    return hmac.new(fleet_secret.encode(), tenant_id.encode(), hashlib.sha256).hexdigest()


def resolve_fleet_secret(secret: str | None) -> str:
    """``--fleet-secret``, else ``$KVROUTE_FLEET_SECRET``, else the dev value (warned about:
    every router and replica of a fleet must agree on it, and a known secret makes salts
    predictable)."""
    secret = secret or os.environ.get(FLEET_SECRET_ENV)
    if secret:
        return secret
    log.warning(
        "no fleet secret (--fleet-secret or $%s): using the development default; "
        "tenant cache salts are predictable",
        FLEET_SECRET_ENV,
    )
    return DEV_FLEET_SECRET


def hash_key(key: str) -> str:
    """How a tenants file stores an API key: ``sha256:<hex>``. A plain digest, not a slow
    password hash: API keys are long random strings (``kvroute key`` makes 32 bytes), which
    no dictionary attack can find, and every request verifies one."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def _check_hash(value: str, where: str) -> str:
    digest = value.removeprefix("sha256:")
    if not value.startswith("sha256:") or len(digest) != 64 or not _HEX.issuperset(digest):
        raise ValueError(
            f"{where}: a key must be stored as 'sha256:<64 hex digits>' "
            "(`kvroute key` prints a new key and its hash)"
        )
    return value.lower()


_HEX = frozenset("0123456789abcdefABCDEF")


class TenantConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One ``[[tenants]]`` table of a tenants file."""

    id: str
    keys: list[str]  # hash_key() of each API key
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    # LoRA adapters it may use by name; ["*"]: all. Absent: none (the base model only).
    adapters: list[str] = []
    # Flow control and the engines' schedulers (vLLM's meaning: lower runs first): its
    # requests' priority when they ask none, and the most urgent they may ask for
    # (absent: ``priority`` itself; any less urgent one is always allowed).
    priority: int = 0
    min_priority: int | None = None

    @property
    def most_urgent(self) -> int:
        return self.priority if self.min_priority is None else self.min_priority

    @property
    def limits(self) -> Limits:
        return Limits(self.requests_per_minute, self.tokens_per_minute, self.max_concurrent)

    @property
    def adapter_grant(self) -> frozenset[str] | None:
        """``adapters`` as :attr:`Tenant.adapters` holds it (None: all)."""
        return None if ALL_ADAPTERS in self.adapters else frozenset(self.adapters)


class TenantsFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``--tenants FILE``: the tenants, and the keys that may read ``/fleet``."""

    tenants: list[TenantConfig]
    admin_keys: list[str] = []


def load_tenants(path: str | os.PathLike[str]) -> TenantsFile:
    """Reads and checks a tenants file (TOML); a ValueError names what is wrong."""
    try:
        data = tomllib.loads(Path(path).read_text())
        spec = msgspec.convert(data, TenantsFile)
    except (tomllib.TOMLDecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    seen_ids: set[str] = set()
    seen_keys: set[str] = set()
    for n, t in enumerate(spec.tenants):
        where = f"{path}: tenants[{n}] ({t.id!r})"
        if not t.id or t.id in seen_ids:
            raise ValueError(f"{where}: a tenant id must be non-empty and unique")
        try:  # ids and adapter names become /metrics labels and log words
            check_name(t.id, "tenant id")
            for a in t.adapters:
                check_name(a, "adapter name")
        except ValueError as exc:
            raise ValueError(f"{path}: tenants[{n}]: {exc}") from None
        if not t.keys:
            raise ValueError(f"{where}: needs at least one key")
        seen_ids.add(t.id)
        try:
            t.limits  # noqa: B018 -- builds (and so checks) the limits: each >= 1
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        if not PRIORITY_MIN <= t.most_urgent <= t.priority <= PRIORITY_MAX:
            raise ValueError(
                f"{where}: priority and min_priority must be 32-bit ints, "
                "min_priority <= priority (lower runs first)"
            )
        if any(not a for a in t.adapters):
            raise ValueError(f"{where}: adapters: an adapter name must be non-empty")
        for k in t.keys:
            if _check_hash(k, where) in seen_keys:
                raise ValueError(f"{where}: a key appears twice in the file")
            seen_keys.add(k.lower())
    for k in spec.admin_keys:
        if _check_hash(k, f"{path}: admin_keys") in seen_keys:
            raise ValueError(f"{path}: an admin key is also a tenant's key")
    return spec


def load_api_keys(path: str | os.PathLike[str]) -> dict[str, str]:
    """API key -> tenant id from a flat key file (``--api-keys``, kept for development): a
    JSON object ``{"key": "tenant", ...}``, or lines ``key:tenant`` (blank lines and ``#``
    comments ignored). Production fleets use a tenants file, which stores only hashes."""
    text = Path(path).read_text()
    if text.lstrip().startswith("{"):
        data = json.loads(text)
        if not isinstance(data, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and k and v for k, v in data.items()
        ):
            raise ValueError(f"{path}: expected a JSON object of non-empty strings")
        for tenant in data.values():
            _check_tenant_id(tenant, str(path))
        return dict(data)
    keys: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, tenant = line.rpartition(":")
        if not sep or not key.strip() or not tenant.strip():
            raise ValueError(f"{path}:{n}: expected 'key:tenant'")
        _check_tenant_id(tenant.strip(), f"{path}:{n}")
        keys[key.strip()] = tenant.strip()
    return keys


def _check_tenant_id(tenant_id: str, where: str) -> None:
    try:
        check_name(tenant_id, "tenant id")
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def resolve_metrics_key(key: str | None, key_file: str | None) -> str | None:
    """The key that may read ``/metrics`` (besides admin keys): ``--metrics-key``, else
    the first line of ``--metrics-key-file`` (the file a Prometheus ``credentials_file``
    can read too), else ``$KVROUTE_METRICS_KEY``, else None. Why a file and a variable: a
    value on the command line is readable by anyone who can list processes. A ValueError
    says what is wrong."""
    if key is not None and key_file is not None:
        raise ValueError("give --metrics-key or --metrics-key-file, not both")
    where = "--metrics-key"
    if key_file is not None:
        where = f"--metrics-key-file {key_file}"
        try:
            lines = Path(key_file).read_text().splitlines()
        except OSError as exc:
            raise ValueError(f"{where}: {exc.strerror or exc}") from None
        key = lines[0] if lines else ""
    elif key is None:
        key = os.environ.get(METRICS_KEY_ENV)
        if key is None:
            return None
        where = f"${METRICS_KEY_ENV}"
    if len(key.split()) != 1:
        raise ValueError(f"{where}: a metrics key must be one non-empty word")
    return key.strip()


def tenants_from_api_keys(api_keys: Mapping[str, str]) -> TenantsFile:
    """A flat key file as a tenants file (keys hashed, no limits, every adapter: a
    development file has no place to say which)."""
    by_tenant: dict[str, list[str]] = {}
    for key, tenant_id in api_keys.items():
        by_tenant.setdefault(tenant_id, []).append(hash_key(key))
    return TenantsFile(
        [
            TenantConfig(t, ks, adapters=[ALL_ADAPTERS], min_priority=PRIORITY_MIN)
            for t, ks in by_tenant.items()
        ]
    )


class Tenants:
    """Authenticates a request's bearer token by its hash; salts are computed once per
    tenant. ``spec`` None: one anonymous tenant, no key needed. ``metrics_key``: a key
    that reads ``/metrics`` and nothing else (a Prometheus scraper's), which then needs it
    or an admin key even on a server without tenant keys; a ValueError if it is a tenant's."""

    def __init__(
        self, spec: TenantsFile | None, fleet_secret: str, metrics_key: str | None = None
    ) -> None:
        self._secret = fleet_secret
        self._by_key: dict[str, Tenant] = {}
        self._admin = frozenset(k.lower() for k in (spec.admin_keys if spec else ()))
        self._metrics = frozenset([hash_key(metrics_key)] if metrics_key else [])
        self.tenants: dict[str, Tenant] = {}
        for t in spec.tenants if spec else ():
            salt = tenant_salt(fleet_secret, t.id)
            tenant = self.tenants[t.id] = Tenant(
                t.id, salt, t.limits, t.adapter_grant, t.priority, t.most_urgent
            )
            self._by_key.update((k.lower(), tenant) for k in t.keys)
        # The anonymous tenant of a server without keys may use every adapter.
        self.default = Tenant(
            DEFAULT_TENANT, tenant_salt(fleet_secret, DEFAULT_TENANT), adapters=None
        )
        if not self.tenants:
            self.tenants[DEFAULT_TENANT] = self.default
        if self._metrics & self._by_key.keys():
            raise ValueError("the metrics key is also a tenant's key: give it a key of its own")

    @property
    def open(self) -> bool:
        """No keys configured: every request is the default tenant."""
        return not self._by_key

    @staticmethod
    def _bearer(authorization: str | None) -> str:
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise AuthError("missing API key: send 'Authorization: Bearer <key>'")
        return hash_key(key.strip())

    def authenticate(self, authorization: str | None) -> Tenant:
        """``Authorization: Bearer <key>`` -> tenant; raises :class:`AuthError`."""
        if self.open:
            return self.default
        digest = self._bearer(authorization)
        tenant = self._by_key.get(digest)
        if tenant is None:
            if digest in self._admin:  # a right key on the wrong door: say so
                raise AuthError("an admin key reads /fleet only; send a tenant's key")
            if digest in self._metrics:
                raise AuthError("the metrics key reads /metrics only; send a tenant's key")
            raise AuthError("incorrect API key provided")
        return tenant

    def is_admin(self, authorization: str | None) -> bool:
        """An admin key (``admin_keys``), or any request when the server is open; False for
        a tenant's key or the metrics key (a 403: known, not allowed). Raises
        :class:`AuthError` when no key or an unknown one is sent."""
        if self.open:
            return True
        digest = self._bearer(authorization)
        if digest in self._admin:
            return True
        if digest not in self._by_key and digest not in self._metrics:
            raise AuthError("incorrect API key provided")
        return False

    def may_scrape(self, authorization: str | None) -> bool:
        """``/metrics``: an admin key or the metrics key; anyone on a server with neither
        tenant keys nor a metrics key (whose one tenant has nothing to hide from itself).
        False for a tenant's key: the series name every tenant and adapter, and each one's
        traffic. Raises :class:`AuthError` when no key or an unknown one is sent."""
        if self.open and not self._metrics:
            return True
        digest = self._bearer(authorization)
        if digest in self._metrics or digest in self._admin:
            return True
        if digest not in self._by_key:
            raise AuthError("incorrect API key provided")
        return False
