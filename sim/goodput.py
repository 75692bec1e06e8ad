"""Goodput: the highest arrival rate each policy serves within an SLO, on a grid of speeds
(:func:`sweep`) or searched per policy (:func:`find_limits`), beside the throughput ceiling
of :mod:`.bounds` (what no policy can sustain).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .bounds import describe_slot_ceiling, slot_ceiling, work_ceiling
from .report import Progress, router_hashes, simulate
from .simulator import SimConfig
from .workloads import RequestSpec, TokenSource

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
        "hit_rate_by_tier": m["hit_rate_by_tier"],
        "ttft_p90_s": m["ttft_s"]["p90"], "e2e_p90_s": m["e2e_s"]["p90"],
        "itl_p90_s": m["itl_s"]["p90"], "preemptions": m["preemptions"],
        "imbalance": m["imbalance"],
        "meets_slo": m["ttft_s"]["p90"] <= slo_ttft_s and m["itl_s"]["p90"] <= slo_itl_s,
        "utilization": utilization, "keeps_up": utilization <= 1.0,
        # one replica's mean share of the fleet's work, per profile (a mixed fleet)
        "work_share_by_profile": {k: d["work_share"] for k, d in m["by_profile"].items()},
        **{k: m[k] for k in ("adapter_loads_per_1k", "adapter_p99_spread") if k in m},
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
    base = make_specs(1.0)
    return {"slo": _slo(slo_ttft_s, slo_itl_s, sustained), "rows": rows, "goodput_rps": goodput,
            "ceiling": _ceiling(base, cfg), "slot_ceiling": slot_ceiling(base, cfg)}  # fmt: skip


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

        ok_speed, fail_speed = search_limit(meets, start, tolerance)
        limits[policy] = {
            "speed_ok": ok_speed,
            "speed_fail": fail_speed,  # None: it still met the SLO at MAX_SPEED
            "rate_ok_rps": None if ok_speed is None else arrivals(ok_speed)[1],
            "rate_fail_rps": None if fail_speed is None else arrivals(fail_speed)[1],
        }
    goodput = {p: limits[p]["rate_ok_rps"] or 0.0 for p in policies}
    base = arrivals(1.0)[0]
    return {"slo": _slo(slo_ttft_s, slo_itl_s, sustained), "rows": rows,
            "goodput_rps": goodput, "limits": limits,
            "ceiling": _ceiling(base, cfg), "slot_ceiling": slot_ceiling(base, cfg)}  # fmt: skip


def search_limit(
    meets: Callable[[float], bool], start: float = 1.0, tolerance: float = LIMIT_TOLERANCE
) -> tuple[float | None, float | None]:
    """(the highest speed found to meet, the lowest found to miss; None: none) by
    :func:`find_limits`' search: double (or halve) from ``start`` until ``meets`` flips,
    then bisect geometrically to within ``tolerance``."""
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
    return ok_speed, fail_speed


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
    c = result.get("slot_ceiling")
    if c is not None:
        line = describe_slot_ceiling(c)
        if c["rate_rps"] is not None:
            goodput = result["goodput_rps"].items()
            line += "; goodput as a share of it: " + ", ".join(
                f"{p} {g / c['rate_rps']:.0%}" for p, g in goodput
            )
        lines.append(line)
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
        slots = result.get("slot_ceiling")
        if slots is not None and slots["rate_rps"] is not None:
            ax.axvline(slots["rate_rps"], color="grey", ls=":", lw=1.5,
                       label="LoRA slot ceiling (estimate)")  # fmt: skip
        ax.set_yscale("log")
        ax.set_xlabel("arrival rate (requests/s)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
