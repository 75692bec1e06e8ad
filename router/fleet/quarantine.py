"""Queries of death: requests that may have crashed an engine, refused for a while.

Why: a request that crashes an engine would, replayed, crash the next replica too, and the
next -- one client taking a fleet down. The front door therefore never replays a request
that may have caused a replica's failure (see :func:`not_caused_by`), and remembers it by
fingerprint -- a hash of its tokens, sampling parameters, tenant and LoRA adapter -- so
that the client's own retry is refused (:class:`QueryOfDeathError`, HTTP 400) instead of
being risked on another replica. An engine that names the request as in its failing step
is two strikes (refused at once); a process that died with no word strikes the one request
the data plane holds answerable (the most recently sent there): one strike, or two when it
was the only one in flight.

Why the tenant and the adapter are in the fingerprint: a quarantine keyed on the content
alone lets one tenant get chosen prompts refused for everyone -- a grant to a broken
adapter, or any crash it can provoke, and the same prompt from every other tenant, on the
base model too, is a 400 for ten minutes. Keyed per tenant and adapter, a prompt struck
for one tenant never refuses another, nor the same tenant's base-model request when the
adapter was the suspect. The cost: a prompt that crashes whatever sends it may strike once
per tenant (and adapter) before each is refused. That is bounded -- each tenant's strikes
quarantine it for that tenant, so no tenant can crash more than the first replica or two
with it -- and it is the price of not letting a tenant deny service to the others.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence

import msgspec

from kvroute.events.replica_api import ReplicaDeadError, ReplicaLostError, SamplingParams

log = logging.getLogger(__name__)

QUARANTINE_S = 600.0
MAX_QUARANTINED = 10_000
STRIKES_TO_REFUSE = 2


class QueryOfDeathError(RuntimeError):
    """The request (by fingerprint) was being computed when a replica failed and is refused
    for a while rather than replayed onto another replica (HTTP 400)."""


def fingerprint(
    prompt_token_ids: Sequence[int],
    sampling: SamplingParams,
    tenant: str | None = None,
    adapter: tuple[str, str] | None = None,
) -> str:
    """What identifies a request across its retries: its tokens and sampling parameters,
    whose it is and the LoRA adapter it runs under (name, folder; None: the base model).
    Another tenant's request, or the base model's, is another fingerprint (module
    docstring)."""
    data = msgspec.msgpack.encode([list(prompt_token_ids), sampling, tenant, adapter])
    return hashlib.sha256(data).hexdigest()[:16]


def not_caused_by(exc: BaseException) -> bool | None:
    """True when the replica's failure cannot have been this request's doing, None when its
    engine says it may have been (it was in the failing step), False when the process died
    with no word and the data plane holds this request answerable
    (:class:`~kvroute.events.replica_api.ReplicaLostError`: the most recently sent of those
    in flight, exactly one per lost process)."""
    if isinstance(exc, ReplicaDeadError):  # the engine's own word
        return None if exc.suspect else True
    if isinstance(exc, ReplicaLostError):
        return not exc.maybe_cause
    return False


class Quarantine:
    """Fingerprint -> (strikes, refused until); oldest first, bounded."""

    def __init__(self, ttl_s: float = QUARANTINE_S, max_entries: int = MAX_QUARANTINED) -> None:
        # Its strikes and refusals (the front door sums every part's counts for /metrics).
        self.errors: Counter[str] = Counter()
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        # Read by the front door before it fingerprints a request: empty, nothing to check.
        self.entries: OrderedDict[str, tuple[int, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self.entries)

    def refused(self) -> int:
        """Fingerprints refused right now."""
        now = time.monotonic()
        return sum(1 for _, until in self.entries.values() if until > now)

    def strike(self, fp: str, request_id: str, replica: str, strikes: int) -> None:
        """Counts a failure of ``replica`` that the request ``fp`` may have caused; at two
        strikes its fingerprint is refused for ``ttl_s``."""
        now = time.monotonic()
        old, until = self.entries.pop(fp, (0, 0.0))
        total = (old if until == 0.0 or until > now else 0) + strikes
        refused = total >= STRIKES_TO_REFUSE
        self.entries[fp] = (total, now + self.ttl_s if refused else 0.0)
        while len(self.entries) > self.max_entries:
            self.entries.popitem(last=False)
        self.errors["suspect_request"] += 1
        log.error(
            "request %s (fingerprint %s) was being computed when replica %s failed: not retried%s",
            request_id,
            fp,
            replica,
            f"; refused for {self.ttl_s:.0f} s" if refused else "",
        )

    def check(self, fp: str) -> None:
        """Raises :class:`QueryOfDeathError` while ``fp`` is refused."""
        entry = self.entries.get(fp)
        if entry is None or entry[1] == 0.0:
            return
        left = entry[1] - time.monotonic()
        if left <= 0:
            del self.entries[fp]
            return
        self.errors["quarantined"] += 1
        log.warning("refused request fingerprint %s: quarantined for %.0f s more", fp, left)
        raise QueryOfDeathError(
            f"This request (fingerprint {fp}) was being computed when a replica failed, so it "
            f"is refused for {left:.0f} s rather than risked on another replica."
        )
