"""A run's figures: latency percentiles, throughput, goodput, hit rate, errors, per replica.

Why one result shape (config + summary + per-request records) in memory and in ``--json``:
a table for one run, the side-by-side table for several (``kvroute bench report``) and the
plot are all drawn from it, so runs taken on different days or against vLLM compare on the
same definitions.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from .sending import Record, count_errors

PCTS = (50, 90, 99)
ITL_STATS = ("p90", "mean")


def percentile(xs: Sequence[float], q: float) -> float:
    """The ``q``-th percentile, linear between order statistics (numpy's default); NaN
    for no values."""
    if not xs:
        return math.nan
    return float(np.percentile(np.asarray(xs, dtype=float), q))


def dist(xs: Sequence[float]) -> dict[str, float]:
    """mean, p50, p90, p99 (NaN when empty) and the count."""
    out = {"mean": float(np.mean(xs)) if xs else math.nan}
    out.update({f"p{q}": percentile(xs, q) for q in PCTS})
    out["n"] = len(xs)
    return out


def request_itl(rec: Record, stat: str) -> float:
    """A request's own ITL figure for the SLO: p90 or mean of its gaps; 0 with none (a
    one-token answer has no gap to miss)."""
    if not rec.itl_s:
        return 0.0
    return percentile(rec.itl_s, 90) if stat == "p90" else float(np.mean(rec.itl_s))


def meets_slo(rec: Record, slo_ttft: float | None, slo_itl: float | None, stat: str) -> bool:
    if not rec.ok or rec.ttft_s is None:
        return False
    if slo_ttft is not None and rec.ttft_s > slo_ttft:
        return False
    return slo_itl is None or request_itl(rec, stat) <= slo_itl


def hits_by_tier(records: Sequence[Record]) -> dict[str, int]:
    """Prompt tokens served from cache, by KV tier: "GPU" the device hits, "CPU" / "STORAGE"
    what replicas loaded from host memory / disk (kvroute's usage extension)."""
    out: Counter[str] = Counter()
    for r in records:
        lower = r.cached_tokens_by_tier or {}
        out["GPU"] += (r.cached_tokens or 0) - sum(lower.values())
        out.update(lower)
    return {k: v for k, v in out.items() if v}


def summarize(
    records: Sequence[Record],
    wall_s: float,
    slo_ttft: float | None = None,
    slo_itl: float | None = None,
    itl_stat: str = "p90",
) -> dict[str, Any]:
    """Every figure of a run; rates are per second of ``wall_s`` (first send to last end)."""
    if itl_stat not in ITL_STATS:
        raise ValueError(f"itl_stat must be one of {ITL_STATS}")
    ok = [r for r in records if r.ok]
    wall = max(wall_s, 1e-9)
    with_usage = [r for r in records if r.prompt_tokens is not None]
    prompt = sum(r.prompt_tokens or 0 for r in with_usage)
    cached = sum(r.cached_tokens or 0 for r in with_usage)
    by_tier = hits_by_tier(with_usage)
    out_tokens = sum(r.output_tokens or 0 for r in ok)
    met = sum(meets_slo(r, slo_ttft, slo_itl, itl_stat) for r in records)
    replicas = Counter(r.replica for r in records if r.replica is not None)
    outside = [r.ttft_s - r.replica_ttft_s for r in ok
               if r.ttft_s is not None and r.replica_ttft_s is not None]  # fmt: skip
    return {
        "requests": len(records),
        "ok": len(ok),
        "errors": count_errors(records),
        "wall_s": wall_s,
        "request_rate": len(ok) / wall,
        "output_token_rate": out_tokens / wall,
        "output_tokens": out_tokens,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_tokens_by_tier": by_tier,
        "hit_rate": cached / prompt if prompt else math.nan,
        "ttft_s": dist([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_s": dist([g for r in ok for g in r.itl_s]),
        "itl_mean_per_request_s": dist([float(np.mean(r.itl_s)) for r in ok if r.itl_s]),
        "e2e_s": dist([r.e2e_s for r in ok if r.e2e_s is not None]),
        # kvroute only: TTFT outside the replica's own (router, HTTP, client), per request
        "ttft_outside_replica_s": dist(outside),
        "goodput": {
            "slo_ttft_s": slo_ttft,
            "slo_itl_s": slo_itl,
            "itl_stat": itl_stat,
            "met": met,
            "rate": met / wall,
        },
        "per_replica": dict(sorted(replicas.items())),
    }


# -- files --------------------------------------------------------------------------------
def to_json(
    label: str, config: dict[str, Any], summary: dict[str, Any], records: Sequence[Record]
) -> bytes:
    """The whole run as JSON: what ``report`` and ``--plot`` read back."""
    doc = {"label": label, "config": config, "summary": summary, "records": records}
    return msgspec.json.format(msgspec.json.encode(_finite(doc)), indent=1)


def _finite(obj: Any) -> Any:
    """NaN (a percentile of nothing) as null: JSON has no NaN."""
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def load_result(path: str | Path) -> dict[str, Any]:
    """A ``--json`` file back, records as :class:`Record` (figures of nothing stay null)."""
    with open(path) as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or not {"summary", "records"} <= set(doc):
        raise ValueError(f"{path}: not a kvroute bench result")
    doc["records"] = msgspec.convert(doc["records"], list[Record])
    doc["label"] = doc.get("label") or Path(path).stem
    return doc


# -- tables -------------------------------------------------------------------------------
def _missing(x: float | None) -> bool:
    return x is None or math.isnan(x)


def _ms(x: float | None) -> str:
    return "-" if _missing(x) else f"{x * 1000:.1f}"


def _rows(
    s: dict[str, Any], replicas: list[str], outside: bool, tiered: bool = False
) -> list[tuple[str, str]]:
    g = s["goodput"]
    slo = [f"TTFT <= {g['slo_ttft_s']} s"] if g["slo_ttft_s"] is not None else []
    if g["slo_itl_s"] is not None:
        slo.append(f"ITL {g['itl_stat']} <= {g['slo_itl_s']} s")
    hit = s["hit_rate"]
    errors = ", ".join(f"{k} {v}" for k, v in s["errors"].items()) or "0"
    rows = [
        ("requests (ok)", f"{s['requests']} ({s['ok']})"),
        ("errors", errors),
        ("wall s", f"{s['wall_s']:.2f}"),
        ("requests/s", f"{s['request_rate']:.2f}"),
        ("output tokens/s", f"{s['output_token_rate']:.1f}"),
        (f"goodput req/s ({'; '.join(slo) or 'no SLO'})", f"{g['rate']:.2f}"),
        ("hit rate (cached/prompt tokens)", "-" if _missing(hit) else f"{hit:.1%}"),
        ("prompt tokens (cached)", f"{s['prompt_tokens']:,} ({s['cached_tokens']:,})"),
    ]
    if tiered:  # some run's replicas loaded from a lower KV tier
        tiers = s.get("cached_tokens_by_tier") or {}
        shown = ", ".join(f"{k} {v:,}" for k, v in tiers.items()) or "0"
        rows.append(("prefix hits by tier (tokens)", shown))
    for name, key in (
        ("TTFT", "ttft_s"),
        ("ITL", "itl_s"),
        ("ITL (request means)", "itl_mean_per_request_s"),
        ("e2e", "e2e_s"),
    ):
        d = s[key]
        for stat in ("mean", *(f"p{q}" for q in PCTS)):
            rows.append((f"{name} {stat} ms", _ms(d[stat])))
    if outside:  # some run has kvroute's timing comment: a row for every run
        d = s.get("ttft_outside_replica_s") or {}
        for stat in ("mean", *(f"p{q}" for q in PCTS)):
            rows.append((f"TTFT outside the replica {stat} ms", _ms(d.get(stat))))
    for rid in replicas:
        rows.append((f"requests on {rid}", str(s["per_replica"].get(rid, 0))))
    return rows


def format_table(results: Sequence[dict[str, Any]]) -> str:
    """One column per run (its label), one row per figure; a markdown table."""
    replicas = sorted({rid for r in results for rid in r["summary"]["per_replica"]}, key=_natural)
    outside = any((r["summary"].get("ttft_outside_replica_s") or {}).get("n") for r in results)
    tiered = any(
        k != "GPU" for r in results for k in r["summary"].get("cached_tokens_by_tier") or {}
    )
    columns = [_rows(r["summary"], replicas, outside, tiered) for r in results]
    labels = [str(r.get("label") or f"run {i}") for i, r in enumerate(results)]
    lines = ["| metric | " + " | ".join(labels) + " |", "| --- |" + " ---: |" * len(labels)]
    for i, (name, _) in enumerate(columns[0]):
        lines.append(f"| {name} | " + " | ".join(col[i][1] for col in columns) + " |")
    return "\n".join(lines)


# -- plot ---------------------------------------------------------------------------------
def _natural(name: str) -> tuple[str, int]:
    """r2 before r10."""
    head = name.rstrip("0123456789")
    tail = name[len(head) :]
    return head, int(tail) if tail else -1


def plot(results: Sequence[dict[str, Any]], path: str | Path) -> None:
    """TTFT CDF per run, and requests per replica per run (grouped bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cdf, bars) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        ttft = sorted(rec.ttft_s * 1000 for rec in r["records"] if rec.ok and rec.ttft_s)
        if ttft:
            cdf.step(ttft, np.arange(1, len(ttft) + 1) / len(ttft), where="post", label=r["label"])
    cdf.set(xlabel="TTFT (ms, log scale)", ylabel="fraction of requests", title="TTFT CDF")
    cdf.set_xscale("log")
    cdf.grid(alpha=0.3)
    cdf.legend()
    replicas = sorted({rid for r in results for rid in r["summary"]["per_replica"]}, key=_natural)
    width = 0.8 / max(1, len(results))
    for i, r in enumerate(results):
        counts = [r["summary"]["per_replica"].get(rid, 0) for rid in replicas]
        xs = np.arange(len(replicas)) + i * width
        bars.bar(xs, counts, width, label=r["label"])
    bars.set_xticks(np.arange(len(replicas)) + width * (len(results) - 1) / 2, replicas)
    if len(replicas) > 12:
        bars.tick_params(axis="x", labelrotation=90, labelsize=7)
    bars.set(xlabel="replica", ylabel="requests", title="requests per replica")
    bars.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
