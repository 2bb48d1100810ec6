"""PNG plots of one or more reports: latency CDFs, the phase breakdown, and a by-group comparison of runs."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from loadgen.report import GROUPS, PHASES


def _plt():  # noqa: ANN202 - matplotlib is imported lazily and headless
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax: Any, values: list[float], label: str) -> None:
    xs = sorted(values)
    if xs:
        ax.plot([x * 1000 for x in xs], [(i + 1) / len(xs) for i in range(len(xs))], label=label)


def latency_cdfs(reports: Sequence[dict[str, Any]], names: Sequence[str], path: str) -> str:
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for rep, name in zip(reports, names, strict=True):
        ok = [r for r in rep["requests"] if r["ok"]]
        _cdf(axes[0], [r["ttft_s"] for r in ok if r["ttft_s"] is not None], name)
        _cdf(axes[1], [g for r in ok for g in r["itl_s"]], name)
        _cdf(axes[2], [r["e2e_s"] for r in ok if r["e2e_s"] is not None], name)
    for ax, title in zip(axes, ("TTFT", "inter-token gap", "end-to-end"), strict=True):
        ax.set_title(f"{title} CDF")
        ax.set_xlabel("ms")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def phase_breakdown(reports: Sequence[dict[str, Any]], names: Sequence[str], path: str) -> str | None:
    """Stacked mean queue/prefill/transfer/decode time per group and run; None when no run has phase data."""
    rows = []
    for rep, name in zip(reports, names, strict=True):
        for g in GROUPS:
            ph = rep["groups"][g]["phase_mean_s"]
            if rep["groups"][g]["requests"] and any(v is not None for v in ph.values()):
                rows.append((f"{name}\n{g}", [ph[p] or 0.0 for p in PHASES]))
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(rows)), 4.5))
    bottom = [0.0] * len(rows)
    for i, p in enumerate(PHASES):
        vals = [r[1][i] * 1000 for r in rows]
        ax.bar([r[0] for r in rows], vals, bottom=bottom, label=p)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_ylabel("mean ms")
    ax.set_title("where the time goes")
    ax.legend()
    ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def by_group(reports: Sequence[dict[str, Any]], names: Sequence[str], path: str) -> str:
    """TTFT p50, ITL p50 and goodput per short/long group, one bar per run (e.g. agg vs disagg)."""
    plt = _plt()
    metrics = (
        ("TTFT p50 (ms)", lambda s: (s["ttft_s"]["p50"] or 0) * 1000),
        ("ITL p50 (ms)", lambda s: (s["itl_s"]["p50"] or 0) * 1000),
        ("goodput (req/s)", lambda s: s["goodput_requests_per_s"]),
    )
    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    width = 0.8 / max(1, len(reports))
    for ax, (title, get) in zip(axes, metrics, strict=True):
        for k, (rep, name) in enumerate(zip(reports, names, strict=True)):
            xs = [i + k * width for i in range(len(GROUPS))]
            ax.bar(
                xs,
                [get(rep["groups"][g]) if rep["groups"][g]["requests"] else 0 for g in GROUPS],
                width,
                label=name,
            )
        ax.set_xticks([i + width * (len(reports) - 1) / 2 for i in range(len(GROUPS))])
        ax.set_xticklabels([g.replace("/", "\n") for g in GROUPS], fontsize=8)
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def all_plots(reports: Sequence[dict[str, Any]], names: Sequence[str], out_dir: str, stem: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = [latency_cdfs(reports, names, os.path.join(out_dir, f"{stem}_cdf.png"))]
    if (p := phase_breakdown(reports, names, os.path.join(out_dir, f"{stem}_phases.png"))) is not None:
        paths.append(p)
    paths.append(by_group(reports, names, os.path.join(out_dir, f"{stem}_groups.png")))
    return paths
