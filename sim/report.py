"""Runs policies over one workload and reports (table, JSON, plot), beside the bounds of
:mod:`.bounds` (what no router can beat: hit rates and a throughput ceiling).

JSON field names are stable; times are seconds, rates fractions of prompt tokens.
"""

from __future__ import annotations

import sys
import time
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvroute.events import BlockHasher

from .bounds import bounds, least_work_s, work_ceiling
from .simulator import Fleet, SimConfig, SimRequest
from .workloads import RequestSpec, TokenSource

Progress = Callable[[str, int, int], None]


def router_hashes(
    specs: Sequence[RequestSpec], cfg: SimConfig, tokens: TokenSource
) -> list[list[bytes]]:
    """Each prompt's salted block hashes, as the front door computes them (once per run)."""
    hasher = BlockHasher(block_size=cfg.block_size)
    out = []
    for spec in specs:
        toks = array("I")
        toks.frombytes(tokens.prompt_bytes(spec))
        out.append(hasher.hash_blocks(toks, cache_salt=spec.cache_salt))
    return out


def _pct(xs: np.ndarray, q: float) -> float:
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


def _dist(xs: np.ndarray) -> dict[str, float]:
    mean = float(xs.mean()) if len(xs) else float("nan")
    return {"mean": mean, "p50": _pct(xs, 50), "p90": _pct(xs, 90), "p99": _pct(xs, 99)}


def summarize(fleet: Fleet, wall_s: float) -> dict[str, Any]:
    done = [r for r in fleet.reqs if r is not None and r.done_s is not None]
    ttft = np.array([r.first_s - r.spec.arrival_s for r in done])  # type: ignore[operator]
    e2e = np.array([r.done_s - r.spec.arrival_s for r in done])  # type: ignore[operator]
    # inter-token latency: each request's mean gap between output tokens after the first
    itl = np.array(
        [(r.done_s - r.first_s) / (r.output_len - 1) for r in done if r.output_len > 1]  # type: ignore[operator]
    )
    prompt = sum(r.prompt_len for r in done)
    hit = sum(r.hit or 0 for r in done)
    out_tokens = sum(r.output_len for r in done)
    t0 = min((r.spec.arrival_s for r in done), default=0.0)
    t1 = max((r.done_s for r in done), default=0.0)  # type: ignore[type-var]
    span = max(t1 - t0, 1e-9)
    busy = np.array([rep.busy_s for rep in fleet.reps])
    # work: tokens each replica computed (prefill, recomputation included, and decode)
    work = np.array([rep.prefill_tokens + rep.decode_tokens for rep in fleet.reps], float)
    total_work = float(work.sum()) or 1.0
    # The least work of what each replica served, at the hits it had (sim.bounds): above the
    # arrival span on any replica, it could not have kept up at that rate for long.
    served: dict[int, list[SimRequest]] = {}
    for r in done:
        served.setdefault(r.replica, []).append(r)
    least = [
        least_work_s([r.spec for r in rs], [r.hit or 0 for r in rs], fleet.cfg.profile(i))
        for i, rs in served.items()
    ]
    return {
        "completed": len(done),
        "rejected": fleet.rejected,
        "prompt_tokens": prompt,
        "hit_tokens": hit,
        "hit_rate": hit / prompt if prompt else 0.0,
        "prefill_tokens": sum(rep.prefill_tokens for rep in fleet.reps),
        "decode_tokens": fleet.decode_tokens,
        "output_tokens": out_tokens,
        "ttft_s": _dist(ttft),
        "e2e_s": _dist(e2e),
        "itl_s": _dist(itl),
        "makespan_s": span,
        "throughput_tok_s": out_tokens / span,
        "requests_per_s": len(done) / span,
        "imbalance": float(work.max() / work.mean()) if work.sum() else 1.0,
        "busy_fraction": float(busy.sum() / (len(busy) * span)) if len(busy) else 0.0,
        "busy_s": float(busy.sum()),  # the fleet's step time, summed over replicas
        "least_work_s": sum(w["seconds"] for w in least),
        "least_work_max_s": max((w["seconds"] for w in least), default=0.0),
        "replicas": [
            {
                "id": rep.id,
                "routed": rep.routed,
                "busy_s": rep.busy_s,
                "work_share": float(w) / total_work,
                "prefill_tokens": rep.prefill_tokens,
                "decode_tokens": rep.decode_tokens,
            }
            for rep, w in zip(fleet.reps, work, strict=True)
        ],
        "by_profile": _by_profile(fleet, work / total_work),
        "preemptions": fleet.preemptions,
        "lost_batches": fleet.lost_batches,
        "wall_s": wall_s,
        "ttft_samples": ttft,  # dropped from JSON; for the plot
    }


def _by_profile(fleet: Fleet, shares: np.ndarray) -> dict[str, dict[str, float]]:
    """Per profile: its replicas, and the mean share of the fleet's work and requests one of
    them took. On a mixed fleet the faster profile's replicas should take more."""
    out: dict[str, dict[str, float]] = {}
    routed = sum(rep.routed for rep in fleet.reps) or 1
    for i, rep in enumerate(fleet.reps):
        d = out.setdefault(
            fleet.cfg.profile(i).name, {"replicas": 0, "work_share": 0.0, "routed_share": 0.0}
        )
        d["replicas"] += 1
        d["work_share"] += float(shares[i])
        d["routed_share"] += rep.routed / routed
    for d in out.values():
        d["work_share"] /= d["replicas"]
        d["routed_share"] /= d["replicas"]
    return out


def simulate(
    specs: Sequence[RequestSpec],
    policies: Sequence[str],
    cfg: SimConfig,
    progress: Progress | None = None,
    with_bounds: bool = True,
) -> dict[str, Any]:
    tokens = TokenSource()
    hashes = router_hashes(specs, cfg, tokens)
    result: dict[str, Any] = {
        "config": {
            "replicas": cfg.replicas,
            "blocks_per_replica": cfg.blocks(0)
            if len({cfg.blocks(i) for i in range(len(cfg.profiles))}) == 1
            else [cfg.blocks(i) for i in range(len(cfg.profiles))],
            "block_size": cfg.block_size,
            "profile": cfg.profile_names,
            "event_delay_s": cfg.event_delay_s,
            "event_loss": cfg.event_loss,
            "seed": cfg.seed,
            "kv_params": dict(cfg.kv_params),
            "long_prefill_token_threshold": cfg.long_prefill_token_threshold,
            "max_num_partial_prefills": cfg.max_num_partial_prefills,
        },
        "workload": {
            "requests": len(specs),
            "prompt_tokens": sum(s.input_length for s in specs),
            "output_tokens": sum(s.output_length for s in specs),
            "span_s": specs[-1].arrival_s - specs[0].arrival_s if specs else 0.0,
        },
    }
    if with_bounds:
        result["bounds"] = bounds(specs, hashes, cfg, tokens)
    result["policies"] = {}
    for name in policies:
        tick = None if progress is None else (lambda d, t, n=name: progress(n, d, t))
        start = time.perf_counter()
        fleet = Fleet(specs, name, cfg, tokens, hashes, tick).run()
        result["policies"][name] = summarize(fleet, time.perf_counter() - start)
    return result


def to_json(result: dict[str, Any]) -> dict[str, Any]:
    """The result without numpy samples: what ``--json`` prints."""
    out = dict(result)
    out["policies"] = {
        k: {f: v for f, v in m.items() if f != "ttft_samples"}
        for k, m in result["policies"].items()
    }
    return out


def format_table(result: dict[str, Any]) -> str:
    cfg, wl = result["config"], result["workload"]
    lines = [
        f"{wl['requests']} requests, {wl['prompt_tokens']:,} prompt tokens, "
        f"{cfg['replicas']} replicas x {cfg['blocks_per_replica']} blocks of "
        f"{cfg['block_size']} tokens ({cfg['profile']})",
    ]
    if "bounds" in result:
        b = result["bounds"]
        lines.append(
            f"bounds: infinite-cache ceiling {b['ceiling_hit_rate']:.3f}, "
            f"pooled ({cfg['replicas']}x{cfg['blocks_per_replica']} blocks, LRU) "
            f"{b['pooled_hit_rate']:.3f}"
        )
        c = b["throughput_ceiling"]
        lines.append(
            f"throughput ceiling (any policy, least work, {c['binding']}-bound): "
            f"{c['rate_rps']:.1f} req/s ({c['speed']:.3g}x this workload's rate)"
        )
    head = (
        f"{'policy':<13}{'hit':>7}{'prefill tok':>14}{'TTFT mean':>10}{'p50':>7}{'p90':>7}"
        f"{'p99':>7}{'e2e mean':>9}{'p90':>7}{'ITL p90':>8}{'tok/s':>7}{'imbal':>6}{'preempt':>8}"
    )
    lines += [head, "-" * len(head)]
    for name, m in result["policies"].items():
        t, e = m["ttft_s"], m["e2e_s"]
        lines.append(
            f"{name:<13}{m['hit_rate']:>7.3f}{m['prefill_tokens']:>14,}"
            f"{t['mean']:>10.2f}{t['p50']:>7.2f}{t['p90']:>7.2f}{t['p99']:>7.2f}"
            f"{e['mean']:>9.2f}{e['p90']:>7.2f}{m['itl_s']['p90'] * 1e3:>6.0f}ms"
            f"{m['throughput_tok_s']:>7.0f}{m['imbalance']:>6.2f}{m['preemptions']:>8}"
        )
    lines.append("work share per replica (prefill + decode tokens computed):")
    for name, m in result["policies"].items():
        shares = " ".join(f"{r['work_share']:.3f}" for r in m["replicas"])
        extra = (
            f"  busy {m['busy_fraction']:.2f}, preempted {m['preemptions']}, "
            f"rejected {m['rejected']}, {m['wall_s']:.0f}s"
        )
        lines.append(f"  {name:<13}{shares}{extra}")
    first = next(iter(result["policies"].values()), None)
    if first is not None and len(first["by_profile"]) > 1:
        lines.append("mean work share of one replica, per profile (and of requests routed):")
        for name, m in result["policies"].items():
            per = "  ".join(
                f"{prof} {d['work_share']:.3f} ({d['routed_share']:.3f})"
                for prof, d in m["by_profile"].items()
            )
            lines.append(f"  {name:<13}{per}")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str, title: str = "") -> None:
    """TTFT CDF per policy and hit-rate bars against the bounds. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, m in result["policies"].items():
        xs = np.sort(m["ttft_samples"])
        ax1.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=name)
    ax1.set_xscale("log")
    ax1.set_xlabel("TTFT (s, log)")
    ax1.set_ylabel("fraction of requests")
    ax1.set_title("TTFT CDF")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend()
    names = list(result["policies"])
    rates = [result["policies"][n]["hit_rate"] for n in names]
    if "bounds" in result:
        names += ["pooled", "ceiling"]
        rates += [result["bounds"]["pooled_hit_rate"], result["bounds"]["ceiling_hit_rate"]]
    ax2.bar(names, rates, color=[f"C{i}" for i in range(len(names))])
    ax2.set_ylabel("prompt tokens served from cache")
    ax2.set_title("hit rate")
    ax2.tick_params(axis="x", rotation=30)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def stderr_progress(name: str, done: int, total: int) -> None:
    width = 30
    fill = width * done // max(total, 1)
    sys.stderr.write(f"\r{name:<13}[{'#' * fill}{'.' * (width - fill)}] {done}/{total}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


# -- goodput: the highest arrival rate each policy serves within an SLO ---------------------
SLO_TTFT_P90_S = 2.0  # defaults for h100-8b, as llm-d and Dynamo report goodput
SLO_ITL_P90_S = 0.1


def _sweep_row(
    policy: str,
    speed: float,
    specs: Sequence[RequestSpec],
    m: dict[str, Any],
    slo_ttft_s: float,
    slo_itl_s: float,
) -> dict[str, Any]:
    """One policy at one speed, as a sweep reports it. ``utilization``: the least work of
    what the busiest replica served (:func:`~.bounds.least_work_s`, at the hits it had, in
    full batches) over the arrival span. Above 1 that replica could not keep up even with
    perfect batching: a finite run may still meet the SLO while its backlog drains after
    the last arrival, but at that rate a longer run's backlog grows without bound
    (``keeps_up`` is False). At or below 1 it may or may not: a necessary condition."""
    span = max(specs[-1].arrival_s - specs[0].arrival_s, 1e-9)
    rate = len(specs) / span
    utilization = m["least_work_max_s"] / span
    return {
        "policy": policy, "speed": speed, "rate_rps": rate, "hit_rate": m["hit_rate"],
        "ttft_p90_s": m["ttft_s"]["p90"], "e2e_p90_s": m["e2e_s"]["p90"],
        "itl_p90_s": m["itl_s"]["p90"], "preemptions": m["preemptions"],
        "imbalance": m["imbalance"],
        "meets_slo": m["ttft_s"]["p90"] <= slo_ttft_s and m["itl_s"]["p90"] <= slo_itl_s,
        "utilization": utilization, "keeps_up": utilization <= 1.0,
        # one replica's mean share of the fleet's work, per profile (a mixed fleet)
        "work_share_by_profile": {k: d["work_share"] for k, d in m["by_profile"].items()},
    }  # fmt: skip


def sweep(
    make_specs: Callable[[float], Sequence[RequestSpec]],
    speeds: Sequence[float],
    policies: Sequence[str],
    cfg: SimConfig,
    slo_ttft_s: float = SLO_TTFT_P90_S,
    slo_itl_s: float = SLO_ITL_P90_S,
    progress: Progress | None = None,
    sustained: bool = True,
) -> dict[str, Any]:
    """Each policy at each arrival-rate multiplier; per policy, the highest rate (requests/s)
    whose TTFT p90 and inter-token p90 both meet the SLO (and, ``sustained``, at which the
    fleet keeps up: see :func:`_sweep_row`)."""
    rows: list[dict[str, Any]] = []
    for speed in sorted(speeds):
        specs = make_specs(speed)
        result = simulate(specs, policies, cfg, progress, with_bounds=False)
        for name, m in result["policies"].items():
            rows.append(_sweep_row(name, speed, specs, m, slo_ttft_s, slo_itl_s))
    goodput = {
        p: max((r["rate_rps"] for r in rows if r["policy"] == p and _counts(r, sustained)),
               default=0.0)
        for p in policies
    }  # fmt: skip
    return {"slo": _slo(slo_ttft_s, slo_itl_s, sustained), "rows": rows, "goodput_rps": goodput,
            "ceiling": _ceiling(make_specs(1.0), cfg)}  # fmt: skip


def _ceiling(specs: Sequence[RequestSpec], cfg: SimConfig) -> dict[str, Any]:
    """The throughput ceiling of the workload at 1x (its speed is a multiple of 1x's rate)."""
    return work_ceiling(specs, router_hashes(specs, cfg, TokenSource()), cfg)


def _counts(row: dict[str, Any], sustained: bool) -> bool:
    """Whether a sweep row's rate counts as goodput."""
    return bool(row["meets_slo"] and (row["keeps_up"] or not sustained))


def _slo(ttft_s: float, itl_s: float, sustained: bool) -> dict[str, Any]:
    return {"ttft_p90_s": ttft_s, "itl_p90_s": itl_s, "sustained": sustained}


LIMIT_TOLERANCE = 0.1  # a limit search stops once its pass and fail speeds are this close
MIN_SPEED, MAX_SPEED = 1 / 64, 256.0  # where a limit search gives up, below and above


def find_limits(
    make_specs: Callable[[float], Sequence[RequestSpec]],
    policies: Sequence[str],
    cfg: SimConfig,
    slo_ttft_s: float = SLO_TTFT_P90_S,
    slo_itl_s: float = SLO_ITL_P90_S,
    progress: Progress | None = None,
    start: float = 1.0,
    tolerance: float = LIMIT_TOLERANCE,
    sustained: bool = True,
) -> dict[str, Any]:
    """Per policy, the highest arrival rate that meets the SLO, searched rather than read
    off a fixed grid: the speed doubles (or halves) from ``start`` until the SLO's verdict
    flips, then a geometric bisection narrows the last passing and first failing speeds to
    within ``tolerance`` of each other. Why: on a grid a policy's limit is only known to lie
    between two points, and two policies whose limits share an interval read as equal.

    Each policy is searched on its own (its speeds differ from the others'); the arrivals of
    a speed are the same for every policy. The search assumes a policy that fails at some
    rate fails above it too; ``limits`` gives the bracketing speeds, and ``rows`` every
    point tried, so a non-monotone verdict shows. Same result shape as :func:`sweep`, with
    ``limits`` added."""
    cache: dict[float, tuple[Sequence[RequestSpec], float]] = {}

    def arrivals(speed: float) -> tuple[Sequence[RequestSpec], float]:
        if speed not in cache:
            specs = make_specs(speed)
            cache[speed] = specs, len(specs) / max(specs[-1].arrival_s - specs[0].arrival_s, 1e-9)
        return cache[speed]

    rows: list[dict[str, Any]] = []
    limits: dict[str, dict[str, float | None]] = {}
    for policy in policies:

        def meets(speed: float, policy: str = policy) -> bool:
            specs = arrivals(speed)[0]
            m = simulate(specs, [policy], cfg, progress, with_bounds=False)["policies"][policy]
            rows.append(_sweep_row(policy, speed, specs, m, slo_ttft_s, slo_itl_s))
            return _counts(rows[-1], sustained)

        ok_speed: float | None = None
        fail_speed: float | None = None
        speed = start
        if meets(speed):
            ok_speed = speed
            while ok_speed < MAX_SPEED:
                speed = min(ok_speed * 2, MAX_SPEED)
                if not meets(speed):
                    fail_speed = speed
                    break
                ok_speed = speed
        else:
            fail_speed = speed
            while fail_speed > MIN_SPEED:
                speed = fail_speed / 2
                if meets(speed):
                    ok_speed = speed
                    break
                fail_speed = speed
        if ok_speed is not None and fail_speed is not None:
            while fail_speed / ok_speed > 1 + tolerance:
                mid = (ok_speed * fail_speed) ** 0.5
                if meets(mid):
                    ok_speed = mid
                else:
                    fail_speed = mid
        limits[policy] = {
            "speed_ok": ok_speed,
            "speed_fail": fail_speed,  # None: it still met the SLO at MAX_SPEED
            "rate_ok_rps": None if ok_speed is None else arrivals(ok_speed)[1],
            "rate_fail_rps": None if fail_speed is None else arrivals(fail_speed)[1],
        }
    goodput = {p: limits[p]["rate_ok_rps"] or 0.0 for p in policies}
    return {"slo": _slo(slo_ttft_s, slo_itl_s, sustained), "rows": rows,
            "goodput_rps": goodput, "limits": limits,
            "ceiling": _ceiling(arrivals(1.0)[0], cfg)}  # fmt: skip


def format_sweep(result: dict[str, Any]) -> str:
    slo = result["slo"]
    head = (
        f"{'policy':<13}{'speed':>6}{'req/s':>8}{'hit':>7}{'TTFT p90':>9}{'e2e p90':>9}"
        f"{'ITL p90':>9}{'preempt':>8}{'util':>6}  SLO"
    )
    lines = [head, "-" * len(head)]
    for r in sorted(result["rows"], key=lambda r: (r["policy"], r["speed"])):
        lines.append(
            f"{r['policy']:<13}{r['speed']:>6g}{r['rate_rps']:>8.2f}{r['hit_rate']:>7.3f}"
            f"{r['ttft_p90_s']:>9.2f}{r['e2e_p90_s']:>9.2f}{r['itl_p90_s'] * 1e3:>7.0f}ms"
            f"{r['preemptions']:>8}{r['utilization']:>6.2f}  {'ok' if r['meets_slo'] else 'missed'}"
            f"{'' if r['keeps_up'] else ', fleet behind'}"
        )
    keeps_up = " and the fleet keeping up (util <= 1)" if slo.get("sustained") else ""
    lines.append(
        f"goodput (highest rate with TTFT p90 <= {slo['ttft_p90_s']:g} s and inter-token p90 "
        f"<= {slo['itl_p90_s'] * 1e3:g} ms{keeps_up}):"
    )
    limits = result.get("limits", {})
    for p, g in result["goodput_rps"].items():
        lim = limits.get(p)
        if lim is None:
            lines.append(f"  {p:<13}{g:.2f} req/s")
        elif lim["speed_fail"] is None:
            lines.append(f"  {p:<13}{g:.2f} req/s or more (met the SLO at {lim['speed_ok']:g}x)")
        elif lim["speed_ok"] is None:
            lines.append(f"  {p:<13}0 (missed the SLO down to {lim['speed_fail']:.3g}x)")
        else:
            lines.append(
                f"  {p:<13}{g:.2f} req/s (met at {lim['speed_ok']:.3g}x, missed at "
                f"{lim['speed_fail']:.3g}x: {lim['rate_fail_rps']:.2f} req/s)"
            )
    c = result.get("ceiling")
    if c is not None:
        shares = ", ".join(f"{p} {g / c['rate_rps']:.0%}" for p, g in result["goodput_rps"].items())
        lines.append(
            f"throughput ceiling (no policy can sustain more; {c['binding']}-bound): "
            f"{c['rate_rps']:.2f} req/s ({c['speed']:.3g}x); goodput as a share of it: {shares}"
        )
    return "\n".join(lines)


def plot_sweep(result: dict[str, Any], path: str, title: str = "") -> None:
    """TTFT p90 and inter-token p90 against arrival rate, per policy, with the SLO lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, ax, slo, label in (
        ("ttft_p90_s", axes[0], result["slo"]["ttft_p90_s"], "TTFT p90 (s, log)"),
        ("itl_p90_s", axes[1], result["slo"]["itl_p90_s"], "inter-token p90 (s, log)"),
    ):
        for p in result["goodput_rps"]:
            rows = sorted((r for r in result["rows"] if r["policy"] == p), key=lambda r: r["speed"])
            ax.plot([r["rate_rps"] for r in rows], [r[key] for r in rows], marker="o", label=p)
        ax.axhline(slo, color="k", ls="--", lw=1, label="SLO")
        ax.set_yscale("log")
        ax.set_xlabel("arrival rate (requests/s)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
