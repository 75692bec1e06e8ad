"""Tenants: API key -> tenant id -> tenant cache salt.

Why a derived salt and not the tenant id itself: the salt enters block 0 of every hash
chain (DESIGN, "Block hashing"), and block hashes travel in clear over the event stream; an
HMAC of the tenant id under a fleet secret cannot be guessed or forged by a client, so no
request of another tenant can name (and hit) a tenant's blocks. A request's own
``cache_salt`` (vLLM's extension field) is appended to the tenant salt: it can split a
tenant's cache further, never reach into another tenant's.

With no keys configured every request is the tenant ``default`` and no Authorization
header is needed (local development, as ``vllm serve`` without ``--api-key``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import msgspec

log = logging.getLogger(__name__)

FLEET_SECRET_ENV = "KVROUTE_FLEET_SECRET"
DEV_FLEET_SECRET = "kvroute-dev-fleet-secret"  # a documented development value
DEFAULT_TENANT = "default"


class AuthError(Exception):
    """The request names no tenant this router knows (HTTP 401)."""


class Tenant(msgspec.Struct, frozen=True):
    tenant_id: str
    cache_salt: str  # hex HMAC-SHA256(fleet secret, tenant id)

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


def load_api_keys(path: str | os.PathLike[str]) -> dict[str, str]:
    """API key -> tenant id from a file: a JSON object ``{"key": "tenant", ...}``, or lines
    ``key:tenant`` (blank lines and ``#`` comments ignored)."""
    text = Path(path).read_text()
    if text.lstrip().startswith("{"):
        data = json.loads(text)
        if not isinstance(data, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and k and v for k, v in data.items()
        ):
            raise ValueError(f"{path}: expected a JSON object of non-empty strings")
        return dict(data)
    keys: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, tenant = line.rpartition(":")
        if not sep or not key.strip() or not tenant.strip():
            raise ValueError(f"{path}:{n}: expected 'key:tenant'")
        keys[key.strip()] = tenant.strip()
    return keys


class Tenants:
    """Authenticates a request's bearer token; salts are computed once per tenant."""

    def __init__(self, api_keys: Mapping[str, str] | None, fleet_secret: str) -> None:
        self._keys = dict(api_keys or {})
        self._secret = fleet_secret
        self._tenants: dict[str, Tenant] = {}
        self.default = self._tenant(DEFAULT_TENANT)

    @property
    def open(self) -> bool:
        """No keys configured: every request is the default tenant."""
        return not self._keys

    def _tenant(self, tenant_id: str) -> Tenant:
        t = self._tenants.get(tenant_id)
        if t is None:
            t = self._tenants[tenant_id] = Tenant(tenant_id, tenant_salt(self._secret, tenant_id))
        return t

    def authenticate(self, authorization: str | None) -> Tenant:
        """``Authorization: Bearer <key>`` -> tenant; raises :class:`AuthError`."""
        if self.open:
            return self.default
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise AuthError("missing API key: send 'Authorization: Bearer <key>'")
        tenant_id = self._keys.get(key.strip())
        if tenant_id is None:
            raise AuthError("incorrect API key provided")
        return self._tenant(tenant_id)


class TenantShares:
    """Each tenant's share of a router's in-flight budget: at most ``cap`` requests at once.

    Why a fixed cap and not a share that grows while a tenant is alone: an admitted stream
    cannot be taken back, so a tenant that filled the whole budget while alone would leave
    a newcomer nothing until its streams ended. A cap below the router's budget (``kvroute
    serve``: half of it when the keys name two tenants or more) always leaves the others
    room. One counter per tenant with requests in flight: O(1) per request.
    """

    def __init__(self, cap: int | None = None) -> None:
        """``cap``: requests one tenant may hold at once (None: no cap of its own)."""
        if cap is not None and cap < 1:
            raise ValueError(f"a tenant's in-flight cap must be >= 1, got {cap}")
        self.cap = cap
        self._counts: Counter[str] = Counter()

    def admit(self, tenant_id: str) -> bool:
        """Counts one more request of the tenant in flight; False (nothing counted) when
        the tenant already holds ``cap``."""
        if self.cap is not None and self._counts[tenant_id] >= self.cap:
            return False
        self._counts[tenant_id] += 1
        return True

    def release(self, tenant_id: str) -> None:
        """One of the tenant's requests ended (once per successful :meth:`admit`)."""
        n = self._counts[tenant_id] - 1
        if n > 0:
            self._counts[tenant_id] = n
        else:  # no entry kept for a tenant with nothing in flight
            self._counts.pop(tenant_id, None)

    def in_flight(self, tenant_id: str) -> int:
        return self._counts.get(tenant_id, 0)
