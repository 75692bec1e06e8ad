"""What ``peers_vllm.py`` prints and draws: the markdown tables and ``peers.png``.

Split out of ``benchmarks/peers_vllm.py`` (which still runs the plot in another Python when
matplotlib is not importable here, as ``peers_vllm.py --replot results.json``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# --- report -----------------------------------------------------------------------------


def fmt(v: Any, spec: str = ",.0f", suffix: str = "") -> str:
    if v is None:
        return "n/a"
    return f"{v:{spec}}{suffix}"


def pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.1f}%"


def engines_table(rows: list[dict]) -> str:
    out = [
        "| engine | dataset | done / failed | TTFT p50 | TTFT p99 | TPOT p50 | output tok/s "
        "| engine hit rate |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        out.append(
            f"| {r['engine']} | {r['dataset']} | {r['completed']} / {r.get('failed') or 0} "
            f"| {fmt(r['median_ttft_ms'], suffix=' ms')} | {fmt(r['p99_ttft_ms'], suffix=' ms')} "
            f"| {fmt(r['median_tpot_ms'], '.1f', ' ms')} | {fmt(r['output_throughput'], '.1f')} "
            f"| {pct(r['hit_rate'])} |"
        )
    return "\n".join(out)


def routers_table(rows: list[dict]) -> str:
    out = ["| front door | done / failed | TTFT p90 | TTFT p50 | output tok/s | hit rate "
           "(engines) | requests per backend | front-door CPU per request | of which idle "
           "|", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for r in rows:
        out.append(
            f"| {r['router']} | {r['completed']} / {r.get('failed') or 0} "
            f"| {fmt(r['p90_ttft_ms'], suffix=' ms')} | {fmt(r['median_ttft_ms'], suffix=' ms')} "
            f"| {fmt(r['output_throughput'], '.1f')} | {pct(r['hit_rate'])} "
            f"| {' / '.join(str(n) for n in r['requests_per_backend'])} "
            f"| {fmt(r['router_cpu_ms_per_request'], '.2f', ' ms')} "
            f"| {fmt(idle_ms(r), '.2f', ' ms')} |"
        )
    return "\n".join(out)


def idle_ms(r: dict) -> float | None:
    """The part of the front door's CPU per request it would have spent idle anyway."""
    a, b = r.get("router_cpu_ms_per_request"), r.get("router_cpu_ms_per_request_less_idle")
    return None if a is None or b is None else a - b


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    eng, rou = results.get("engines") or [], results.get("routers") or []
    panels = (2 if eng else 0) + (3 if rou else 0)
    if not panels:
        return
    fig, axes = plt.subplots(1, panels, figsize=(3.6 * panels, 3.8), squeeze=False)
    ax_iter = iter(axes[0])
    if eng:
        datasets = list(dict.fromkeys(r["dataset"] for r in eng))
        engines = list(dict.fromkeys(r["engine"] for r in eng))
        for key, title in (("output_throughput", "output tok/s"),
                           ("median_ttft_ms", "TTFT p50 (ms)")):  # fmt: skip
            ax = next(ax_iter)
            w = 0.8 / len(engines)
            for j, e in enumerate(engines):
                vals = [next((r[key] or 0 for r in eng if r["engine"] == e and r["dataset"] == d),
                             0) for d in datasets]  # fmt: skip
                ax.bar([i + j * w for i in range(len(datasets))], vals, w, label=e)
            ax.set_xticks([i + 0.4 - w / 2 for i in range(len(datasets))], datasets)
            ax.set_title(f"engines: {title}")
            ax.legend(fontsize=8)
    if rou:
        names = [r["router"] for r in rou]
        panels_b = (
            ("p90_ttft_ms", "TTFT p90 (ms)", 1),
            ("hit_rate", "engines' hit rate (%)", 100),
            ("router_cpu_ms_per_request", "front-door CPU ms/request", 1),
        )
        for key, title, scale in panels_b:
            ax = next(ax_iter)
            ax.bar(range(len(names)), [(r[key] or 0) * scale for r in rou])
            ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
            ax.set_title(f"routers: {title}")
    fig.suptitle(results["setup"]["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
