"""transmla sweep: convert at several KV-cache budgets, evaluate each, table and plot."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ..eval.sweep import EvalSettings, parse_budgets
from ..eval.sweep import sweep as run_sweep
from ..progress import stderr_console
from .common import JsonFlag, emit, pick_device, pick_dtype, stdout

Opt = typer.Option


def sweep(
    source: Annotated[str, typer.Argument(help="Local HF folder, .gguf file, hub id, or the built-in 'smollm2-135m'.")],
    out: Annotated[Path, Opt("--out", help="Folder for sweep.json, sweep.md, sweep.png (and models/ with --keep).")],
    method: Annotated[str, Opt(help="transmla | mha2mla, or both comma-separated (one line each).")] = "transmla",
    budgets: Annotated[str, Opt(help="Fractions of the source KV cache, comma-separated.")] = "0.5,0.25,0.125",
    data: Annotated[str, Opt(help="Evaluation text: wiki | lee | a .txt/.jsonl PATH | a dataset name.")] = "wiki",
    text_field: Annotated[str, Opt(help="Field holding the text in JSONL / datasets.")] = "text",
    seq_len: Annotated[int, Opt(help="Tokens per window.")] = 512,
    max_windows: Annotated[int | None, Opt(help="Evaluate at most this many windows.")] = None,
    stride: Annotated[int | None, Opt(help="Sliding-window protocol with this stride (default: non-overlapping).")] = None,
    context: Annotated[int, Opt(help="Report the KV cache size at this many tokens.")] = 8192,
    measure_cache: Annotated[int, Opt("--measure-cache", help="Generate this many tokens per model and measure the cache (0: skip).")] = 0,
    calib: Annotated[str | None, Opt(help="Calibration text (default: the convert default, wiki).")] = None,
    calib_samples: Annotated[int | None, Opt(help="Calibration sequences.")] = None,
    calib_seq_len: Annotated[int | None, Opt(help="Tokens per calibration sequence.")] = None,
    freqfold: Annotated[str | None, Opt(help="transmla: frequencies folded per PCA group, or 'auto' (the sweep default).")] = None,
    rope_select: Annotated[str | None, Opt(help="mha2mla: high | low | uniform | 2norm.")] = None,
    svd_weighting: Annotated[str | None, Opt(help="mha2mla: none | activation.")] = None,
    keep: Annotated[bool, Opt("--keep", help="Keep the converted models under OUT/models/.")] = False,
    batch_size: Annotated[int, Opt(help="Windows per forward pass.")] = 4,
    dtype: Annotated[str, Opt(help="fp32 | bf16 | fp16, for evaluation.")] = "fp32",
    device: Annotated[str, Opt(help="auto | cpu | cuda.")] = "auto",
    as_json: JsonFlag = False,
) -> None:
    """Convert SOURCE at each KV budget, evaluate every model under one protocol, plot perplexity vs cache."""
    pick_dtype(dtype)
    methods = [m.strip() for m in method.split(",") if m.strip()]
    settings = EvalSettings(
        data=data, text_field=text_field, seq_len=seq_len, max_windows=max_windows, stride=stride,
        batch_size=batch_size, dtype=dtype, device=pick_device(device), context=context, measure_tokens=measure_cache,
    )
    overrides = {
        "calib": calib, "calib_samples": calib_samples, "calib_seq_len": calib_seq_len, "freqfold": freqfold, "rope_select": rope_select,
        "svd_weighting": svd_weighting, "device": device,
    }
    result = run_sweep(source, methods, parse_budgets(budgets), out, settings,
                       {k: v for k, v in overrides.items() if v is not None}, keep=keep)
    if as_json:
        emit(result, True, "")
        return
    src = result["source"]
    table = Table(title=f"sweep: {source}", caption=f"protocol ({result['protocol']['name']}): "
                  f"{result['protocol']['description']}", caption_justify="left")
    for h in ("method", "budget", "KV el./token/layer", "R + r", "perplexity", "vs source"):
        table.add_column(h)
    table.add_row("source", "1", str(src["kv_elements_per_token_per_layer"]), "–", f"{src['perplexity']:.2f}", "")
    for r in result["rows"]:
        label = r["method"] + (f" ({r['setting']})" if r.get("setting") else "")
        table.add_row(label, f"{r['budget']:g}", str(r["kv_elements_per_token_per_layer"]),
                      f"{r.get('kv_lora_rank')} + {r.get('qk_rope_head_dim')}", f"{r['perplexity']:.2f}",
                      f"x{r['perplexity'] / src['perplexity']:.2f}")
    stdout.print(table)
    stderr_console.print(f"[dim]written: {out / 'sweep.json'}, {out / 'sweep.md'}, {out / 'sweep.png'}[/dim]")
