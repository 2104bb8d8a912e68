"""A budget sweep's Markdown report (sweep.md): perplexity against the fraction of the source KV
cache, one row per method or setting, the source first."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .formatting import format_ppl, md_table


def render_sweep_markdown(sweep: Mapping[str, Any], plot: str | None = None) -> str:
    """sweep.md: one row per (method, budget), the source first."""
    src = sweep["source"]
    env = sweep["environment"]
    p = sweep["protocol"]
    header = ["method", "setting", "budget", "KV el./token/layer", "cache fraction", "R (d_c)", "r (d_rope)",
              "perplexity", "vs source", "convert s (CPU s)", "eval s (CPU s)"]
    tasks = list(src.get("tasks") or {})  # task scores beside perplexity (sweep --tasks)
    header[8:8] = [f"{t} {sweep.get('task_scores', {}).get(t, 'acc')}" for t in tasks]
    rows = [["source", src["attention"], "1", str(src["kv_elements_per_token_per_layer"]), "1", "–", "–",
             format_ppl(src["perplexity"]), *(f"{src['tasks'][t]:.1%}" for t in tasks), "", "",
             _fmt_s(src.get("eval_seconds"), src.get("eval_cpu_seconds"))]]
    for r in sweep["rows"]:
        rows.append([
            r["method"], r.get("setting") or "default", f"{r['budget']:g}", str(r["kv_elements_per_token_per_layer"]),
            f"{r['cache_fraction']:.4g}", str(r.get("kv_lora_rank", "–")), str(r.get("qk_rope_head_dim", "–")),
            format_ppl(r["perplexity"]), *(f"{r['tasks'][t]:.1%}" for t in tasks), f"x{r['perplexity'] / src['perplexity']:.2f}",
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
        md_table(header, rows),
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


__all__ = ["render_sweep_markdown"]
