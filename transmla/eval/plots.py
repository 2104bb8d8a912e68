"""The reports' PNG plots (matplotlib's Agg backend: no display needed): a comparison's perplexity
and KV-cache bars, a sweep's perplexity against the fraction of the source cache, and a
fine-tuning run's training loss and held-out perplexity."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .formatting import format_bytes, format_ppl


def pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"]


def plot_curves(train_log: list[dict], eval_log: list[dict], path: Path, title: str | None = None) -> None:
    """Training loss and held-out perplexity against optimizer steps (PNG)."""
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    if train_log:
        steps = [r["step"] for r in train_log]
        loss = [r["loss"] for r in train_log]
        ax1.plot(steps, loss, lw=0.6, alpha=0.5, label="per step")
        k = max(1, len(loss) // 30)
        smooth = [sum(loss[max(0, i - k + 1) : i + 1]) / len(loss[max(0, i - k + 1) : i + 1]) for i in range(len(loss))]
        ax1.plot(steps, smooth, lw=1.5, label=f"mean of {k}")
        ax1.set_xlabel("optimizer step")
        ax1.set_ylabel("training loss (nats/token)")
        ax1.legend()
    by_windows: dict[int, list[dict]] = {}
    for r in eval_log:
        by_windows.setdefault(r["windows"], []).append(r)
    for windows, rows in sorted(by_windows.items()):
        style = "o-" if len(rows) > 2 else "s"
        ax2.plot([r["step"] for r in rows], [r["perplexity"] for r in rows], style, label=f"{windows} windows x {rows[0].get('seq_len', '')}")
    if eval_log:
        ax2.set_xlabel("optimizer step")
        ax2.set_ylabel("held-out perplexity")
        ax2.set_yscale("log")
        ax2.legend()
    if title:
        fig.suptitle(title[:120], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_compare(report: Mapping[str, Any], out_dir: Path) -> list[Path]:
    """perplexity.png (bars) and kv_cache.png (KV bytes per token, formula and measured)."""
    plt = pyplot()
    models = report["models"]
    labels = [f"{m['role']}\n{m['attention']}" + (f" ({m['method']})" if m.get("method") else "") for m in models]
    colors = ["#7f7f7f" if m["role"] == "source" else COLORS[0] for m in models]
    paths = []

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    vals = [m["perplexity"] for m in models]
    bars = ax.bar(labels, vals, color=colors)
    for b, v in zip(bars, vals):
        ax.annotate(format_ppl(v), (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=10)
    ax.set_ylabel("perplexity (lower is better)")
    p = report["protocol"]
    ax.set_title(f"Perplexity on {p['data']}: {p['tokens']:,} tokens, {p['name']} {p['seq_len']}-token windows", fontsize=9)
    paths.append(_save_bars(plt, fig, ax, max(vals) * 1.18, out_dir / "perplexity.png"))

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    per_token = [m["kv_bytes_per_token"] / 1024 for m in models]
    bars = ax.bar(labels, per_token, color=colors, label="formula")
    for b, m in zip(bars, models):
        txt = f"{m['kv_elements_per_token_per_layer']} el./layer\n{m['kv_bytes_per_token'] / 1024:,.1f} KiB/token"
        ax.annotate(txt, (b.get_x() + b.get_width() / 2, b.get_height() / 2), ha="center", va="center",
                    fontsize=9, color="white", fontweight="bold")
    measured_x, measured_y = [], []
    for i, m in enumerate(models):
        mc = m.get("measured_cache")
        if mc:
            measured_x.append(i)
            measured_y.append(mc["measured_bytes_per_token_per_layer"] * m["layers"] / 1024)
    if measured_x:
        ax.plot(measured_x, measured_y, "kD", markersize=8, linestyle="none", label="measured after generation")
        ax.legend(loc="upper right", fontsize=8)
    ctx = report.get("context")
    title = "KV cache per token (all layers)"
    if ctx:
        title += "; at {:,} tokens: ".format(ctx) + " vs ".join(format_bytes(m.get("kv_bytes_at_context")) for m in models)
    ax.set_title(title, fontsize=9)
    ax.set_ylabel(f"KiB per token ({models[0]['cache_dtype']})")
    paths.append(_save_bars(plt, fig, ax, max(per_token) * 1.35, out_dir / "kv_cache.png"))
    return paths


def _save_bars(plt, fig, ax, top: float, path: Path) -> Path:
    """A bar plot's end: y from 0 to `top`, a light grid, written to `path` and closed."""
    ax.set_ylim(0, top)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_sweep(
    lines: Mapping[str, Sequence[tuple[float, float]]],
    source_ppl: float | None,
    path: Path,
    title: str,
    source_label: str = "source model",
    subtitle: str | None = None,
) -> Path:
    """Perplexity (log scale) against the kept fraction of the source KV cache.

    ``lines``: label -> [(cache fraction, perplexity)], one line per method or setting;
    the source model is a dashed horizontal line at fraction 1.
    """
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    fractions: set[float] = set()
    for i, (label, pts) in enumerate(lines.items()):
        pts = sorted(p for p in pts if p[1] is not None and math.isfinite(p[1]))
        if not pts:
            continue
        xs, ys = zip(*pts)
        fractions.update(xs)
        color = COLORS[i % len(COLORS)]
        ax.plot(xs, ys, "o-", color=color, label=label, linewidth=2, markersize=6)
        for x, y in pts:
            ax.annotate(format_ppl(y), (x, y), textcoords="offset points", xytext=(6, 6), fontsize=8, color=color)
    if source_ppl is not None:
        ax.axhline(source_ppl, color="black", linestyle="--", linewidth=1.2, label=f"{source_label}: {format_ppl(source_ppl)}")
    fractions.add(1.0)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = sorted(fractions)
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{t:.4g}\n({t:.1%})" for t in ticks], fontsize=8)
    ax.minorticks_off()
    ax.set_xlim(min(ticks) / 1.25, 1.25)
    ax.set_xlabel("KV cache kept (fraction of the source model's cache per token)")
    ax.set_ylabel("perplexity (log scale, lower is better)")
    ax.set_title(title + (f"\n{subtitle}" if subtitle else ""), fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


__all__ = ["COLORS", "plot_compare", "plot_curves", "plot_sweep", "pyplot"]
