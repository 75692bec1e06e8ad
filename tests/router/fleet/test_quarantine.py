"""The query-of-death bookkeeping alone: fingerprints, strikes, expiry, bounds, and which
failures count as the request's possible doing."""

from __future__ import annotations

import pickle
import time

import pytest

from kvroute.events.replica_api import (
    BoundsError,
    ReplicaDeadError,
    ReplicaLostError,
    SamplingParams,
)
from kvroute.router.fleet.quarantine import (
    Quarantine,
    QueryOfDeathError,
    fingerprint,
    not_caused_by,
)


def test_fingerprint_is_the_content_the_tenant_and_the_adapter() -> None:
    spec = SamplingParams(max_tokens=5, temperature=0.5, seed=3)
    fp = fingerprint([1, 2, 3], spec, "acme", ("support", "/a/support"))
    same = SamplingParams(max_tokens=5, temperature=0.5, seed=3)
    assert fp == fingerprint((1, 2, 3), same, "acme", ("support", "/a/support"))
    assert len(fp) == 16
    others = [
        fingerprint([1, 2, 4], spec, "acme", ("support", "/a/support")),
        fingerprint([1, 2, 3], SamplingParams(max_tokens=5, temperature=0.5, seed=4), "acme",
                    ("support", "/a/support")),
        fingerprint([1, 2, 3], spec, "globex", ("support", "/a/support")),  # another tenant
        fingerprint([1, 2, 3], spec, "acme", None),  # the same tenant's base model
        fingerprint([1, 2, 3], spec, "acme", ("legal", "/a/support")),  # another adapter
        fingerprint([1, 2, 3], spec, "acme", ("support", "/a/support-v2")),  # loaded anew
    ]  # fmt: skip
    assert len({fp, *others}) == 1 + len(others)


def test_a_prompt_struck_for_one_tenant_refuses_no_other() -> None:
    """One tenant with a grant to a broken adapter must not get chosen prompts refused for
    everyone: its strikes quarantine the prompt for it, under that adapter, only."""
    q = Quarantine()
    spec = SamplingParams(max_tokens=4)
    mine = fingerprint([7, 8, 9], spec, "acme", ("broken", "/a/broken"))
    q.strike(mine, "req-1", "r0", strikes=2)
    with pytest.raises(QueryOfDeathError):
        q.check(
            fingerprint([7, 8, 9], SamplingParams(max_tokens=4), "acme", ("broken", "/a/broken"))
        )
    q.check(fingerprint([7, 8, 9], spec, "globex", None))  # another tenant, the base model
    q.check(fingerprint([7, 8, 9], spec, "globex", ("broken", "/a/broken")))  # its adapter too
    q.check(fingerprint([7, 8, 9], spec, "acme", None))  # acme's own base-model request
    assert q.refused() == 1 and q.errors["quarantined"] == 1


def test_two_strikes_refuse_until_the_time_is_up() -> None:
    q = Quarantine(ttl_s=0.3)
    q.strike("a", "req-1", "r0", strikes=1)  # a process death: one strike, still served
    q.check("a")
    q.strike("a", "req-2", "r1", strikes=1)  # a second one: refused
    with pytest.raises(QueryOfDeathError, match="fingerprint a"):
        q.check("a")
    q.strike("b", "req-3", "r0", strikes=2)  # the engine named it: refused at once
    with pytest.raises(QueryOfDeathError):
        q.check("b")
    assert q.refused() == 2 and q.errors["suspect_request"] == 3 and q.errors["quarantined"] == 2
    time.sleep(0.35)  # what is under test: the quarantine's time runs out
    q.check("a")  # expired: served again, and forgotten
    assert q.refused() == 0 and len(q) == 1
    q.strike("b", "req-4", "r0", strikes=1)  # strikes past their refusal start over
    q.check("b")


def test_bounded_oldest_first() -> None:
    q = Quarantine(max_entries=3)
    for fp in "abcd":
        q.strike(fp, "req", "r0", strikes=2)
    assert len(q) == 3
    q.check("a")  # the oldest was dropped
    with pytest.raises(QueryOfDeathError):
        q.check("d")


def test_which_failures_cannot_be_the_requests_doing() -> None:
    in_step = ReplicaDeadError("engine step failed", suspect=True)
    queued = ReplicaDeadError("engine step failed", suspect=False)
    assert not_caused_by(in_step) is None  # the engine's word
    assert not_caused_by(queued) is True
    # A process gone with no word: the one request held answerable, and the others.
    assert not_caused_by(ReplicaLostError("gone", maybe_cause=True)) is False
    assert not_caused_by(ReplicaLostError("gone", maybe_cause=False)) is True
    assert not_caused_by(RuntimeError("anything else")) is False  # nobody can tell


def test_the_contract_errors_keep_their_fields_across_ray() -> None:
    """Ray pickles exceptions: the suspect flag and a bound's field must survive it."""
    for suspect in (True, False):
        err = pickle.loads(pickle.dumps(ReplicaDeadError("gone", suspect=suspect)))
        assert err.suspect is suspect and str(err) == "gone"
    bound = pickle.loads(pickle.dumps(BoundsError("seed", "must be an int")))
    assert bound.param == "seed" and str(bound) == "seed: must be an int"
