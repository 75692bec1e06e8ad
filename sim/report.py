"""Runs policies over one workload and reports (table, JSON, plot), beside the bounds of
:mod:`.bounds` (what no router can beat: hit rates and a throughput ceiling); goodput
sweeps over many runs are :mod:`.goodput`'s.

JSON field names are stable; times are seconds, rates fractions of prompt tokens.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvroute.events import BlockHasher

from .bounds import bounds, describe_slot_ceiling, least_work_s
from .disagg import HandedOff
from .lora import adapter_metrics
from .simulator import POOLED, SimConfig, SimRun, split_policy
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
        out.append(hasher.hash_blocks(toks, cache_salt=spec.cache_salt, lora_name=spec.lora_name))
    return out


def _pct(xs: np.ndarray, q: float) -> float:
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


def _dist(xs: np.ndarray) -> dict[str, float]:
    mean = float(xs.mean()) if len(xs) else float("nan")
    return {"mean": mean, "p50": _pct(xs, 50), "p90": _pct(xs, 90), "p99": _pct(xs, 99)}


def summarize(fleet: SimRun, wall_s: float) -> dict[str, Any]:
    done = [r for r in fleet.reqs if r is not None and r.done_s is not None]
    ttft = np.array([r.first_s - r.spec.arrival_s for r in done])  # type: ignore[operator]
    e2e = np.array([r.done_s - r.spec.arrival_s for r in done])  # type: ignore[operator]
    # inter-token latency: each request's mean gap between output tokens after the first
    itl = np.array(
        [(r.done_s - r.first_s) / (r.output_len - 1) for r in done if r.output_len > 1]  # type: ignore[operator]
    )
    prompt = sum(r.prompt_len for r in done)
    hit = sum(r.hit or 0 for r in done)
    host_hit = sum(r.host_hit for r in done)  # of ``hit``: loaded from a host tier
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
    served: dict[int, list[tuple[RequestSpec, int]]] = {}
    for r in done:
        if isinstance(r, HandedOff):  # P/D: its prefill on one replica, the rest on another
            solo = dataclasses.replace(r.spec, output_length=1)
            served.setdefault(r.prefill_replica, []).append((solo, r.hit or 0))
            served.setdefault(r.replica, []).append((r.spec, r.decode_hit or 0))
        else:
            served.setdefault(r.replica, []).append((r.spec, r.hit or 0))
    least = [
        least_work_s([s for s, _ in rs], [h for _, h in rs], fleet.cfg.profile(i))
        for i, rs in served.items()
    ]
    return {
        "completed": len(done),
        "rejected": fleet.rejected,
        "prompt_tokens": prompt,
        "hit_tokens": hit,
        "hit_rate": hit / prompt if prompt else 0.0,  # every tier's
        "hit_tokens_by_tier": {"GPU": hit - host_hit, "CPU": host_hit},
        "hit_rate_by_tier": {
            "GPU": (hit - host_hit) / prompt if prompt else 0.0,
            "CPU": host_hit / prompt if prompt else 0.0,
        },
        # host tier copies (tokens): loads (preempted requests' reloads included) and
        # evicted blocks copied out; the host link's busy seconds, summed over replicas
        "host_loaded_tokens": sum(rep.loaded_tokens for rep in fleet.reps),
        "host_stored_tokens": sum(rep.stored_tokens for rep in fleet.reps),
        "host_transfer_s": sum(rep.transfer_s for rep in fleet.reps),
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
        **(
            adapter_metrics(done, fleet.adapter_loads, fleet.adapter_reads)
            if fleet.cfg.lora
            else {}
        ),
        **({"pd": fleet.pd.metrics()} if fleet.pd is not None else {}),
    }


def _by_profile(fleet: SimRun, shares: np.ndarray) -> dict[str, dict[str, float]]:
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
            "host_blocks_per_replica": cfg.host_blocks(0),
            "host_bandwidth_bytes_s": sorted({p.host_bandwidth for p in cfg.profiles}),
            "lora": None if cfg.lora is None else dataclasses.asdict(cfg.lora),
            **(
                {
                    "prefill_replicas": cfg.prefill_replicas,
                    "decode_replicas": cfg.decode_replicas,
                    "pd_split": cfg.pd_split,
                    "pd_pair": cfg.pd_pair,
                    "link_bytes_per_s": cfg.link_bytes_per_s,
                    "link_latency_s": cfg.link_latency_s,
                }
                if cfg.has_roles
                else {}
            ),
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
        if split_policy(name)[0] == POOLED:  # no router: one replica (pooled:nohost as :nohost)
            run = name.replace(POOLED, "round_robin", 1)
            fleet = SimRun(specs, run, cfg.pooled(), tokens, hashes, tick).run()
        else:
            fleet = SimRun(specs, name, cfg, tokens, hashes, tick).run()
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
    lines += _bound_lines(result)
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
    lines += _feature_lines(result)
    lines += _share_lines(result)
    return "\n".join(lines)


def _bound_lines(result: dict[str, Any]) -> list[str]:
    """:func:`format_table`'s bounds: the hit-rate and throughput ceilings (none when not
    computed)."""
    cfg = result["config"]
    lines: list[str] = []
    if "bounds" in result:
        b = result["bounds"]
        tiered = b.get("pooled_tiered_hit_rate")
        lines.append(
            f"bounds: infinite-cache ceiling {b['ceiling_hit_rate']:.3f}, "
            f"pooled ({cfg['replicas']}x{cfg['blocks_per_replica']} blocks, LRU) "
            f"{b['pooled_hit_rate']:.3f}"
            + ("" if tiered is None else f", pooled with the host tiers {tiered:.3f}")
        )
        c = b["throughput_ceiling"]
        lines.append(
            f"throughput ceiling (any policy, least work, {c['binding']}-bound): "
            f"{c['rate_rps']:.1f} req/s ({c['speed']:.3g}x this workload's rate)"
        )
        if b.get("slot_ceiling") is not None:
            lines.append(describe_slot_ceiling(b["slot_ceiling"]))
    return lines


def _feature_lines(result: dict[str, Any]) -> list[str]:
    """:func:`format_table`'s lines for the fleet's host tiers, LoRA adapters and P/D roles,
    each where the run had them."""
    cfg = result["config"]
    lines: list[str] = []
    if cfg.get("host_blocks_per_replica"):
        lines.append(
            f"hits by tier (host tier {cfg['host_blocks_per_replica']} blocks per replica; "
            "loaded: every load, reloads after preemption included):"
        )
        for name, m in result["policies"].items():
            t = m["hit_rate_by_tier"]
            lines.append(
                f"  {name:<13}device {t['GPU']:.3f}  host {t['CPU']:.3f}  "
                f"loaded {m['host_loaded_tokens']:,} tokens, copied out "
                f"{m['host_stored_tokens']:,}, link {m['host_transfer_s']:.1f}s"
            )
    if cfg.get("lora"):
        lo = cfg["lora"]
        lines.append(
            f"LoRA adapters ({lo['max_loras']} slots, {lo['max_cpu_loras']} in host memory per "
            f"replica, rank {lo['rank']}): loads into slots and reads from disk per 1,000 "
            "requests; TTFT p99 per adapter, the median adapter's and the worst's (and the "
            "worst's p99 wait before its first step):"
        )
        for name, m in result["policies"].items():
            lines.append(
                f"  {name:<13}loads {m['adapter_loads_per_1k']:7.1f}  reads "
                f"{m['adapter_reads_per_1k']:6.1f}  p99 median {m['adapter_p99_median_s']:6.2f}s"
                f"  worst {m['adapter_p99_worst_s']:6.2f}s ({m['adapter_p99_spread']:.2f}x;"
                f" queued {m['adapter_worst_queued_p99_s']:.2f}s)"
            )
    if cfg.get("prefill_replicas") or cfg.get("decode_replicas") or cfg.get("pd_pair"):
        lines.append(
            f"P/D: {cfg['prefill_replicas']} prefill, {cfg['decode_replicas']} decode, "
            f"{cfg['replicas'] - cfg['prefill_replicas'] - cfg['decode_replicas']} both; "
            f"split {cfg['pd_split']}{' (pair)' if cfg.get('pd_pair') else ''}; "
            f"link {cfg['link_bytes_per_s'] / 1e9:g} GB/s, "
            f"{cfg['link_latency_s'] * 1e3:g} ms:"
        )
        for name, m in result["policies"].items():
            pd = m["pd"]
            lines.append(
                f"  {name:<13}split {pd['split_requests']} of "
                f"{pd['split_requests'] + pd['whole_requests']}, pulls {pd['pulls']} "
                f"({pd['pulled_tokens']:,} tokens, {pd['pull_s_mean'] * 1e3:.1f} ms mean), "
                f"none {pd['no_pull']}, no room {pd['pull_no_room']}, failed "
                f"{pd['pull_failed']}; decoders prefilled {pd['decoders_prefill_tokens']:,} tokens"
            )
    return lines


def _share_lines(result: dict[str, Any]) -> list[str]:
    """:func:`format_table`'s work share per replica, and per profile on a mixed fleet."""
    lines = ["work share per replica (prefill + decode tokens computed):"]
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
    return lines


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
    host = [result["policies"][n].get("hit_rate_by_tier", {}).get("CPU", 0.0) for n in names]
    if "bounds" in result:
        b = result["bounds"]
        names += ["pooled", "ceiling"]
        rates += [b["pooled_hit_rate"], b["ceiling_hit_rate"]]
        if "pooled_tiered_hit_rate" in b:
            names.insert(-1, "pooled+host")
            rates.insert(-1, b["pooled_tiered_hit_rate"])
        host += [0.0] * (len(names) - len(host))
    colors = [f"C{i}" for i in range(len(names))]
    ax2.bar(names, rates, color=colors)
    if any(host):  # the host tier's share of each bar, hatched
        ax2.bar(names, host, color=colors, hatch="//", edgecolor="white", label="from host")
        ax2.legend()
    ax2.set_ylabel("prompt tokens served from cache")
    ax2.set_title("hit rate (hatched: loaded from the host tier)" if any(host) else "hit rate")
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
