"""P/D disaggregation in the simulator (issue 51): a split run finishes every request, its
decode replicas compute only the tails, its transfers are counted and take the link's time,
its leases end, the router's own split rule decides; a fleet without roles (or with no
prefill replica) runs exactly as before."""

from __future__ import annotations

import json

import pytest

from kvroute.deploy.cli import main
from kvroute.replica.model.cost_model import H100_8B
from kvroute.router.routing import disagg as router_disagg
from kvroute.sim.disagg import HandedOff, roles_of
from kvroute.sim.report import router_hashes, summarize
from kvroute.sim.simulator import Fault, SimConfig, SimRun
from kvroute.sim.workloads import TokenSource, make_workload

BS = 64


def fleet(specs, cfg: SimConfig, policy: str = "kv") -> SimRun:
    src = TokenSource()
    return SimRun(specs, policy, cfg, src, router_hashes(specs, cfg, src)).run()


def split_cfg(**kw) -> SimConfig:
    base = dict(replicas=4, block_size=BS, prefill_replicas=1, decode_replicas=3)
    return SimConfig(**{**base, **kw, "pd_split": kw.get("pd_split", "always")})


def tail(n: int) -> int:
    """What a decode replica computes of a handed-off prompt of n tokens: the part past its
    last full block, and the first token."""
    return n - (n // BS) * BS + 1


def test_split_run_finishes_every_request_with_transfers_counted():
    specs = make_workload("rag", 150, seed=1, speed=1.0)
    f = fleet(specs, split_cfg(event_delay_s=0.02))
    pd = f.pd
    assert pd is not None
    s = pd.stats
    done = [r for r in f.reqs if r is not None and r.done_s is not None]
    assert len(done) == len(specs)
    assert s.split == s.handoffs == len(specs) and s.whole == 0  # always: every one splits
    assert s.pulls + s.no_pull + s.no_room + s.failed == s.handoffs
    assert s.pulls > 0.9 * len(specs) and not s.no_room and not s.failed
    # every pull crossed the link: its bytes over 50 GB/s, and then its latency
    assert s.pulled_tokens == sum(r.pulled_tokens for r in done)  # type: ignore[attr-defined]
    assert s.link_s == pytest.approx(s.pulled_tokens * H100_8B.kv_bytes_per_token / 50e9)
    assert s.pull_s >= s.link_s + s.pulls * 1e-3 - 1e-9
    prefill = f.reps[0]
    assert prefill.decode_tokens == 0 and prefill.routed == len(specs)
    assert all(isinstance(r, HandedOff) and r.prefill_replica == 0 for r in done)
    for r in done:  # the client's first token is the prefill replica's, before the decode
        assert r.spec.arrival_s < r.first_s < r.done_s  # type: ignore[operator]
        assert r.replica != 0
    f.index.check_invariants()
    for rep in f.reps:  # the pulled blocks' events reached the index as the replicas' own
        assert f.index.counts(rep.id) == rep.kv.block_pool.cached_hash_counts(), rep.id
    for rep in f.reps[1:]:  # what its pulls took, in its load reports, as the engine's
        link = rep.load_report().kv_link_bytes_per_s
        assert 1e9 < link < 50e9, rep.id  # the link's, less its latency and queue
    assert f.reps[0].load_report().kv_link_bytes_per_s == 0
    m = summarize(f, 0.0)
    assert m["completed"] == len(specs) and m["pd"]["pulls"] == s.pulls
    assert m["pd"]["roles"] == ["prefill", "decode", "decode", "decode"]


def test_decode_replicas_compute_only_the_tails():
    specs = make_workload("rag", 150, seed=2, speed=1.0)
    f = fleet(specs, split_cfg())
    assert f.preemptions == 0 and not f.pd.stats.failed and not f.pd.stats.no_room  # type: ignore[union-attr]
    done = [r for r in f.reqs if r is not None]
    for i, rep in enumerate(f.reps[1:], start=1):
        mine = [r for r in done if r.replica == i]
        assert mine
        # the tails, exactly (a prompt of whole blocks: its first step there, one token, is
        # a decode step's shape and counts as one)
        assert rep.prefill_tokens == sum(tail(r.prompt_len) for r in mine if r.prompt_len % BS)
        for r in mine:  # the whole prompt but its tail was there: pulled or its own
            assert r.decode_hit >= (r.prompt_len // BS) * BS  # type: ignore[attr-defined]
    # the prefill replica computed every prompt (less its hits) and made each first token
    prompt = sum(r.prompt_len for r in done)
    assert f.reps[0].prefill_tokens == prompt - sum(r.hit for r in done)  # type: ignore[misc]
    # each later token is a decode step, but the second, made with the tail
    assert f.decode_tokens == sum(r.output_len - 2 for r in done) + sum(
        1 for r in done if r.prompt_len % BS == 0
    )


def test_leases_end_and_pools_hold_nothing_after_the_run():
    specs = make_workload("chat", 120, seed=3, speed=2.0)
    f = fleet(specs, split_cfg(prefill_replicas=2, decode_replicas=2))
    for rep in f.reps:
        leases = rep.scheduler.leases
        if leases is not None:
            leases.poll()  # released ones end at the replica's next step
            assert len(leases) == 0 and leases.stats["granted"] > 0
            assert leases.stats["released"] == leases.stats["granted"]
        pool = rep.kv.block_pool
        pool.check_invariants()
        assert pool.get_num_free_blocks() == pool.num_blocks  # nothing held


def test_fast_decode_path_is_exact_with_roles():
    specs = make_workload("chat", 150, seed=4, speed=3.0)
    cfg = split_cfg(event_loss=0.1)
    fast = fleet(specs, cfg)
    cfg.fast_decode = False
    slow = fleet(specs, cfg)
    assert sum(rep.num_runs for rep in fast.reps) > 50
    for a, b in zip(fast.reqs, slow.reqs, strict=True):
        assert a is not None and b is not None and a.replica == b.replica
        assert a.first_s == pytest.approx(b.first_s, rel=1e-9)
        assert a.done_s == pytest.approx(b.done_s, rel=1e-9)


def _per_request(f: SimRun) -> list[tuple]:
    return [(r.replica, r.first_s, r.done_s, r.hit) for r in f.reqs if r is not None]


@pytest.mark.parametrize("decode", [0, 3])
def test_a_fleet_without_prefill_replicas_runs_as_before(decode):
    """No prefill replica, no split: every replica decoding (or no roles at all) is the
    fleet it was, request for request."""
    specs = make_workload("rag", 200, seed=5, speed=2.0)
    plain = fleet(specs, SimConfig(replicas=3, block_size=BS))
    assert plain.pd is None and all(rep.scheduler.leases is None for rep in plain.reps)
    roled = fleet(specs, SimConfig(replicas=3, block_size=BS, decode_replicas=decode))
    assert _per_request(roled) == _per_request(plain)
    a, b = summarize(plain, 0.0), summarize(roled, 0.0)
    for m in (a, b):
        m.pop("ttft_samples"), m.pop("wall_s")
    pd = b.pop("pd", None)
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    assert (pd is None) == (decode == 0) and (pd is None or pd["handoffs"] == 0)


def test_priced_split_is_the_routers_split_pays(monkeypatch):
    specs = make_workload("rag", 120, seed=6, speed=2.0)
    cfg = split_cfg(pd_split="priced")
    calls = []

    def never(*args, **kw):
        calls.append(args)
        return False

    monkeypatch.setattr(router_disagg, "split_pays", never)
    f = fleet(specs, cfg)
    assert len(calls) == len(specs)  # asked once per request, with the fleet's policy
    assert f.pd.stats.split == 0 and f.reps[0].routed == 0  # type: ignore[union-attr]
    assert all(r is not None and r.done_s is not None for r in f.reqs)
    monkeypatch.setattr(router_disagg, "split_pays", lambda *a, **k: True)
    yes = fleet(specs, cfg)
    always = fleet(specs, split_cfg())
    assert _per_request(yes) == _per_request(always)


@pytest.mark.parametrize(
    "replica, kinds, counter", [(0, ("restart",), "failed"), (2, ("restart",), "dropped"),
                                (3, ("down", "up"), "dropped")],
)  # fmt: skip
def test_a_restart_on_either_side_loses_no_request(replica, kinds, counter):
    """A prefill replica that restarts under pulls from it: they bring nothing, their
    requests compute their prompts; a decode replica that restarts (or goes down) under
    pulls to it: their requests are retried, as those it ran are. A slow link (2 GB/s)
    keeps pulls in flight when it happens."""
    specs = make_workload("rag", 200, seed=7, speed=2.0)
    t = specs[len(specs) // 2].arrival_s
    faults = tuple(Fault(t + 2.0 * k, replica, kind) for k, kind in enumerate(kinds))
    cfg = split_cfg(prefill_replicas=2, decode_replicas=2, link_bytes_per_s=2e9, faults=faults)
    f = fleet(specs, cfg)
    assert getattr(f.pd.stats, counter) > 0  # type: ignore[union-attr]
    assert all(r is not None and r.done_s is not None for r in f.reqs)
    for rep in f.reps:
        rep.kv.block_pool.check_invariants()
        assert f.index.counts(rep.id) == rep.kv.block_pool.cached_hash_counts(), rep.id
        leases = rep.scheduler.leases
        if leases is not None:
            leases.poll()
            assert len(leases) == 0


def test_roles_are_checked():
    assert roles_of(1, 2, 4) == ["prefill", "decode", "decode", "both"]
    with pytest.raises(ValueError):
        roles_of(3, 2, 4)
    with pytest.raises(ValueError):
        SimConfig(replicas=2, prefill_replicas=1, pd_split="sometimes").roles()
    assert not SimConfig().has_roles and SimConfig().pooled().roles() == ["both"]
    assert not SimConfig(prefill_replicas=2, decode_replicas=6).pooled().has_roles


def test_cli_runs_a_split_fleet(capsys):
    args = ["simulate", "--workload", "rag", "--limit", "80", "--replicas", "3",
            "--prefill-replicas", "1", "--decode-replicas", "2", "--pd-split", "always",
            "--link-gbps", "25", "--policy", "kv", "--no-bounds", "--json",
            "--no-progress"]  # fmt: skip
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["link_bytes_per_s"] == 25e9
    pd = out["policies"]["kv"]["pd"]
    assert pd["handoffs"] == pd["split_requests"] == 80 and pd["pulls"] > 0
    assert out["policies"]["kv"]["completed"] == 80
    bad = ["simulate", "--workload", "rag", "--limit", "10", "--replicas", "2",
           "--prefill-replicas", "2", "--decode-replicas", "1"]  # fmt: skip
    assert main(bad) == 2
    assert "--prefill-replicas" in capsys.readouterr().err


def test_cli_sweeps_a_split_fleet_at_a_tight_slo(capsys):
    args = ["simulate", "--workload", "rag", "--limit", "60", "--replicas", "2",
            "--prefill-replicas", "1", "--decode-replicas", "1", "--policy", "kv",
            "--sweep-speed", "0.5,1", "--slo-itl", "0.05", "--json", "--no-progress"]  # fmt: skip
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["slo"]["itl_p90_s"] == 0.05 and len(out["rows"]) == 2
    assert all(r["itl_p90_s"] > 0 for r in out["rows"]) and "kv" in out["goodput_rps"]


def pair_cfg(**kw) -> SimConfig:
    return SimConfig(**{"replicas": 4, "block_size": BS, "pd_pair": True, **kw})


def test_pairs_on_a_fleet_of_both_split_between_two_replicas():
    """pd_pair (every replica both), every request split (always): each one's prefill on
    one replica, its decode on another that pulled the prompt; leases all end."""
    specs = make_workload("rag", 150, seed=8, speed=2.0)
    f = fleet(specs, pair_cfg(pd_split="always"))
    s = f.pd.stats  # type: ignore[union-attr]
    done = [r for r in f.reqs if r is not None and r.done_s is not None]
    assert len(done) == len(specs) and s.split == s.handoffs == len(specs)
    assert all(isinstance(r, HandedOff) and r.replica != r.prefill_replica for r in done)
    assert s.pulls > 0.9 * len(specs) and not s.failed
    assert len({r.prefill_replica for r in done}) > 1 and len({r.replica for r in done}) > 1
    f.index.check_invariants()
    for rep in f.reps:
        assert f.index.counts(rep.id) == rep.kv.block_pool.cached_hash_counts(), rep.id
        rep.scheduler.leases.poll()  # type: ignore[union-attr]
        assert len(rep.scheduler.leases) == 0  # type: ignore[arg-type]
    assert summarize(f, 0.0)["pd"]["pd_pair"] is True


def test_pairs_that_never_pay_are_the_unified_fleet(monkeypatch):
    """pd_pair priced, the price never saying a pair pays: the fleet of both as it was,
    request for request (the leases and pulls every replica carries change nothing)."""
    specs = make_workload("rag", 200, seed=5, speed=3.0)
    plain = fleet(specs, SimConfig(replicas=4, block_size=BS))
    calls = []

    def never(*args, **kw):
        calls.append(args)
        return None

    monkeypatch.setattr(router_disagg, "best_pair", never)
    paired = fleet(specs, pair_cfg())
    assert len(calls) == len(specs)  # priced once per request
    assert paired.pd.stats.split == 0 and _per_request(paired) == _per_request(plain)  # type: ignore[union-attr]


def test_priced_pairs_follow_the_price():
    """pd_pair priced on a loaded fleet: the splits it makes are the ones best_pair chose,
    each decode on the replica the price named."""
    specs = make_workload("rag", 300, seed=9, speed=6.0)
    f = fleet(specs, pair_cfg())
    s = f.pd.stats  # type: ignore[union-attr]
    assert s.split == s.handoffs and s.split + s.whole == len(specs)
    assert all(r is not None and r.done_s is not None for r in f.reqs)
    assert not f.pd.decode_for  # type: ignore[union-attr]  # every chosen decode was used


def test_cli_pairs_only_when_asked(capsys):
    base = ["simulate", "--workload", "rag", "--limit", "40", "--replicas", "3", "--policy",
            "kv", "--no-bounds", "--json", "--no-progress"]  # fmt: skip
    assert main(base) == 0
    assert "pd" not in json.loads(capsys.readouterr().out)["policies"]["kv"]  # default: off
    assert main([*base, "--pd-split", "always"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["pd_pair"] and out["policies"]["kv"]["pd"]["handoffs"] == 40
