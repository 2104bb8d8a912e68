"""Evaluation reports: report.json, report.md and PNG plots, readable at a glance.

Two kinds of report share the helpers here:

- a comparison (``transmla eval MODEL --compare SOURCE --report DIR``): one entry per model
  (perplexity, KV elements and bytes per token per layer and for the whole model at a context,
  the cache measured after generating tokens), the change against the source, the protocol;
- a budget sweep (``transmla sweep``): perplexity against the fraction of the source KV cache,
  one line per method or setting, the source model as a horizontal line;

and ``plot_curves`` draws a fine-tuning run's training loss and held-out perplexity.

Plots use matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:  # annotations only: the report module imports no torch
    from .kv import KVSummary
    from .measured_cache import MeasuredCache
    from .perplexity import PerplexityResult

__all__ = [
    "MIB",
    "ModelEntry",
    "compare_rows",
    "format_bytes",
    "model_entry",
    "plot_compare",
    "plot_sweep",
    "protocol_info",
    "render_compare_markdown",
    "render_sweep_markdown",
    "write_compare_report",
    "write_json",
]

MIB = 1024 * 1024


# --- facts ----------------------------------------------------------------------------------


def protocol_info(result: PerplexityResult, data: str, text_field: str = "text") -> dict[str, Any]:
    """The evaluation protocol of a perplexity result, named and described."""
    name = result.protocol
    L, n, tokens = result.seq_len, result.windows, result.tokens
    if name == "sliding":
        text = (
            f"token-level perplexity exp(mean NLL), sliding window (Hugging Face guide): a {L}-token context "
            f"moved by stride {result.stride} in {n} steps, each token scored once ({tokens:,} scored tokens), "
            f"no special tokens added"
        )
    else:
        text = (
            f"token-level perplexity exp(mean NLL) over the first {n} non-overlapping {L}-token windows "
            f"({tokens:,} scored tokens: every token but the first of each window), no special tokens added"
        )
    return {
        "name": name,
        "seq_len": L,
        "stride": result.stride,
        "windows": n,
        "tokens": tokens,
        "data": data,
        "text_field": text_field,
        "description": f"{text}; text: {describe_data(data)}",
    }


def describe_data(data: str) -> str:
    if data in ("wiki", "lee"):
        return f"{data!r}, the built-in evaluation part (last 20% of the characters, never used for calibration)"
    if data == "code":
        return "'code', the built-in evaluation part (standard-library modules n..z, never used for calibration)"
    return repr(data)


@dataclass
class ModelEntry:
    """One model's line of a report; a dict (to_dict, the key order of report.json) only when written."""

    model: str
    role: str
    attention: str
    method: str | None
    layers: int
    perplexity: float
    nll: float
    tokens: int
    windows: int
    cache_dtype: str
    kv_elements_per_token_per_layer: int
    kv_bytes_per_token_per_layer: int
    kv_bytes_per_token: int
    context: int | None
    kv_bytes_at_context: int | None
    # MLA / source geometry: written only when known
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    measured_cache: MeasuredCache | None = None
    eval_seconds: float | None = None
    eval_cpu_seconds: float | None = None  # all threads of the process; written only when measured

    OPTIONAL: ClassVar[tuple[str, ...]] = ("kv_lora_rank", "qk_rope_head_dim", "kv_heads", "head_dim", "eval_cpu_seconds")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name in self.OPTIONAL:
                continue
            out[f.name] = value.to_dict() if f.name == "measured_cache" and value is not None else value
        return out


def model_entry(
    spec: str,
    role: str,
    kv: KVSummary,
    ppl: PerplexityResult,
    measured: MeasuredCache | None = None,
    eval_seconds: float | None = None,
) -> ModelEntry:
    """One model's line of a report: perplexity, KV accounting (``kv_summary(config, dtype, context)``)
    and, if measured, the cache after generation."""
    kv = kv.to_dict()
    return ModelEntry(
        model=spec,
        role=role,
        attention=kv["attention"],
        method=kv.get("method"),
        layers=kv["layers"],
        perplexity=ppl.perplexity,
        nll=ppl.nll,
        tokens=ppl.tokens,
        windows=ppl.windows,
        cache_dtype=kv["cache_dtype"],
        kv_elements_per_token_per_layer=kv["kv_elements_per_token_per_layer"],
        kv_bytes_per_token_per_layer=kv["kv_bytes_per_token_per_layer"],
        kv_bytes_per_token=kv["kv_bytes_per_token"],
        context=kv.get("context"),
        kv_bytes_at_context=kv.get("kv_bytes_at_context"),
        **{key: kv.get(key) for key in ("kv_lora_rank", "qk_rope_head_dim", "kv_heads", "head_dim")},
        measured_cache=measured,
        eval_seconds=eval_seconds,
    )


def comparison(model: Mapping[str, Any], source: Mapping[str, Any]) -> dict[str, Any]:
    """Change of the model against the source (same protocol, same tokens)."""
    if model["tokens"] != source["tokens"]:
        raise ValueError(
            f"the two models scored different token counts ({model['tokens']} vs {source['tokens']}): "
            "they need the same tokenizer and protocol to be compared"
        )
    delta = model["perplexity"] - source["perplexity"]
    out = {
        "perplexity_change": delta,
        "perplexity_change_pct": 100.0 * delta / source["perplexity"],
        "nll_change": model["nll"] - source["nll"],
        "cache_ratio": model["kv_elements_per_token_per_layer"] / source["kv_elements_per_token_per_layer"],
        "cache_bytes_ratio": model["kv_bytes_per_token"] / source["kv_bytes_per_token"],
    }
    if model.get("kv_bytes_at_context") is not None and source.get("kv_bytes_at_context") is not None:
        out["kv_bytes_saved_at_context"] = source["kv_bytes_at_context"] - model["kv_bytes_at_context"]
    mm, sm = model.get("measured_cache"), source.get("measured_cache")
    if mm and sm:
        out["measured_cache_ratio"] = mm["measured_bytes_per_token_per_layer"] / sm["measured_bytes_per_token_per_layer"]
    return out


# --- formatting -----------------------------------------------------------------------------


def format_bytes(n: float | None) -> str:
    if n is None:
        return "–"
    for unit, size in (("GiB", 1024**3), ("MiB", MIB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{int(n):,} B"


def _ppl(x: float) -> str:
    return f"{x:,.2f}" if x < 1e5 else f"{x:.3g}"


def _label(entry: Mapping[str, Any]) -> str:
    method = entry.get("method")
    kind = entry["attention"] + (f", {method}" if method else "")
    return f"{entry['role']} ({kind})"


def compare_rows(report: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The comparison table as a header and rows of strings (used by the CLI and report.md)."""
    models = report["models"]
    cmp = report.get("comparison")
    header = ["", *(_label(m) for m in models)] + (["change"] if cmp else [])
    context = report.get("context")
    rows: list[list[str]] = []

    def row(name: str, values: Sequence[str], change: str = "") -> None:
        rows.append([name, *values] + ([change] if cmp else []))

    row("model", [str(m["model"]) for m in models])
    change = f"{cmp['perplexity_change']:+,.2f} ({cmp['perplexity_change_pct']:+.1f}%)" if cmp else ""
    row("perplexity", [_ppl(m["perplexity"]) for m in models], change)
    row("tokens evaluated", [f"{m['tokens']:,}" for m in models])
    row("KV elements / token / layer", [str(m["kv_elements_per_token_per_layer"]) for m in models],
        f"x{cmp['cache_ratio']:.4g}" if cmp else "")
    row("KV bytes / token / layer", [f"{m['kv_bytes_per_token_per_layer']:,} ({m['cache_dtype']})" for m in models])
    row("KV bytes / token (all layers)", [f"{m['kv_bytes_per_token']:,} ({m['layers']} layers)" for m in models])
    if context:
        saved = cmp.get("kv_bytes_saved_at_context") if cmp else None
        row(f"KV cache at {context:,} tokens", [format_bytes(m.get("kv_bytes_at_context")) for m in models],
            "" if not saved else (f"-{format_bytes(saved)}" if saved > 0 else f"+{format_bytes(-saved)}"))
    if any(m.get("measured_cache") for m in models):
        def measured(m):
            mc = m.get("measured_cache")
            if not mc:
                return "–"
            ok = "= formula" if mc["matches_formula"] else f"formula {mc['formula_bytes']:,}"
            return f"{mc['measured_bytes']:,} B for {mc['cached_tokens']} tokens ({ok})"

        row("measured cache after generation", [measured(m) for m in models],
            f"x{cmp['measured_cache_ratio']:.4g}" if cmp and "measured_cache_ratio" in cmp else "")
    if cmp:
        row("cache ratio (model / source)", ["" for _ in models[:-1]] + [f"{cmp['cache_ratio']:.4g}"])
    return header, rows


def _md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    esc = [[c.replace("|", "\\|") for c in r] for r in [header, *rows]]
    lines = ["| " + " | ".join(esc[0]) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in esc[1:]]
    return "\n".join(lines)


def render_compare_markdown(report: Mapping[str, Any], plots: Sequence[str] = ()) -> str:
    models = report["models"]
    env = report["environment"]
    title = "Evaluation: " + " vs ".join(str(m["model"]) for m in models)
    header, rows = compare_rows(report)
    parts = [
        f"# {title}",
        "",
        f"**Protocol** ({report['protocol']['name']}): {report['protocol']['description']}.",
        "",
        _md_table(header, rows),
        "",
    ]
    cmp = report.get("comparison")
    if cmp:
        parts += [
            f"The converted model keeps {cmp['cache_ratio']:.1%} of the source's KV cache per token and changes "
            f"perplexity by {cmp['perplexity_change']:+,.2f} ({cmp['perplexity_change_pct']:+.1f}%).",
            "",
        ]
    if any(m.get("measured_cache") for m in models):
        parts += [
            "Measured cache: a prompt is prefilled and tokens are generated greedily one at a time through the "
            "model's own cache; the bytes every layer's cache tensors hold are counted and set beside "
            "`elements per token per layer x layers x cached tokens x bytes per element`.",
            "",
        ]
    for p in plots:
        parts += [f"![{Path(p).stem}]({Path(p).name})", ""]
    parts += [
        f"Machine: {env['machine']}" + (f", GPU {env['gpu']}" if env.get("gpu") else "")
        + f"; Python {env['python']}, torch {env['torch']}, transformers {env['transformers']}; {env['date']}.",
        "",
    ]
    return "\n".join(parts)


# --- plots ----------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"]


def plot_curves(train_log: list[dict], eval_log: list[dict], path: Path, title: str | None = None) -> None:
    """Training loss and held-out perplexity against optimizer steps (PNG)."""
    plt = _pyplot()
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
    plt = _pyplot()
    models = report["models"]
    labels = [f"{m['role']}\n{m['attention']}" + (f" ({m['method']})" if m.get("method") else "") for m in models]
    colors = ["#7f7f7f" if m["role"] == "source" else COLORS[0] for m in models]
    paths = []

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    vals = [m["perplexity"] for m in models]
    bars = ax.bar(labels, vals, color=colors)
    for b, v in zip(bars, vals):
        ax.annotate(_ppl(v), (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=10)
    ax.set_ylabel("perplexity (lower is better)")
    p = report["protocol"]
    ax.set_title(f"Perplexity on {p['data']}: {p['tokens']:,} tokens, {p['name']} {p['seq_len']}-token windows", fontsize=9)
    ax.set_ylim(0, max(vals) * 1.18)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    paths.append(out_dir / "perplexity.png")
    fig.savefig(paths[-1])
    plt.close(fig)

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
    ax.set_ylim(0, max(per_token) * 1.35)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    paths.append(out_dir / "kv_cache.png")
    fig.savefig(paths[-1])
    plt.close(fig)
    return paths


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
    plt = _pyplot()
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
            ax.annotate(_ppl(y), (x, y), textcoords="offset points", xytext=(6, 6), fontsize=8, color=color)
    if source_ppl is not None:
        ax.axhline(source_ppl, color="black", linestyle="--", linewidth=1.2, label=f"{source_label}: {_ppl(source_ppl)}")
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


def render_sweep_markdown(sweep: Mapping[str, Any], plot: str | None = None) -> str:
    """sweep.md: one row per (method, budget), the source first."""
    src = sweep["source"]
    env = sweep["environment"]
    p = sweep["protocol"]
    header = ["method", "setting", "budget", "KV el./token/layer", "cache fraction", "R (d_c)", "r (d_rope)",
              "perplexity", "vs source", "convert s (CPU s)", "eval s (CPU s)"]
    tasks = list(src.get("tasks") or {})  # multiple-choice accuracies beside perplexity (sweep --tasks)
    header[8:8] = [f"{t} acc" for t in tasks]
    rows = [["source", src["attention"], "1", str(src["kv_elements_per_token_per_layer"]), "1", "–", "–",
             _ppl(src["perplexity"]), *(f"{src['tasks'][t]:.1%}" for t in tasks), "", "",
             _fmt_s(src.get("eval_seconds"), src.get("eval_cpu_seconds"))]]
    for r in sweep["rows"]:
        rows.append([
            r["method"], r.get("setting") or "default", f"{r['budget']:g}", str(r["kv_elements_per_token_per_layer"]),
            f"{r['cache_fraction']:.4g}", str(r.get("kv_lora_rank", "–")), str(r.get("qk_rope_head_dim", "–")),
            _ppl(r["perplexity"]), *(f"{r['tasks'][t]:.1%}" for t in tasks), f"x{r['perplexity'] / src['perplexity']:.2f}",
            _fmt_s(r.get("convert_seconds"), r.get("convert_cpu_seconds")),
            _fmt_s(r.get("eval_seconds"), r.get("eval_cpu_seconds")),
        ])
    parts = [
        f"# KV-budget sweep: {sweep['source_model']}",
        "",
        f"Command: `{sweep['command']}`",
        "",
        f"**Protocol** ({p['name']}): {p['description']}. Training-free conversions "
        f"(calibration: {sweep.get('calibration', 'see sweep.json')}), {sweep['dtype']}.",
        "",
        _md_table(header, rows),
        "",
    ]
    if plot:
        parts += [f"![perplexity vs KV-cache fraction]({Path(plot).name})", ""]
    parts += [
        f"Machine: {env['machine']}" + (f", GPU {env['gpu']}" if env.get("gpu") else "")
        + f"; Python {env['python']}, torch {env['torch']}, transformers {env['transformers']}; {env['date']}. "
        "Times: wall seconds, and in brackets the CPU seconds of this process (all its threads); the CPU was shared "
        "with other jobs while measured, so wall times are inflated.",
        "",
    ]
    return "\n".join(parts)


def _fmt_s(x: float | None, cpu: float | None = None) -> str:
    if x is None:
        return ""
    return f"{x:,.0f}" + (f" ({cpu:,.0f})" if cpu is not None else "")


# --- files ----------------------------------------------------------------------------------


def write_json(data: Any, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return path


def write_compare_report(report: Mapping[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """report.json, report.md, perplexity.png, kv_cache.png in out_dir (created)."""
    from ..checkpoint.files import refuse_symlinks

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    refuse_symlinks(out_dir)
    plots = plot_compare(report, out_dir)
    files = {"json": write_json(report, out_dir / "report.json")}
    md = out_dir / "report.md"
    md.write_text(render_compare_markdown(report, [str(p) for p in plots]))
    files["md"] = md
    for p in plots:
        files[p.stem] = p
    return files


def command_line() -> str:
    """The command as the user typed it (best effort)."""
    argv = list(sys.argv)
    if argv and argv[0].endswith(("transmla", "app.py", "__main__.py")):
        argv[0] = "transmla"
    import shlex

    return " ".join(shlex.quote(a) for a in argv)
