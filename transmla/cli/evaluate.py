"""transmla eval: perplexity and KV cache of a model, alone or against its source, with a report."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ..eval.report import compare_rows, write_compare_report
from ..eval.sweep import EvalSettings, compare_report, evaluate_model
from ..progress import stderr_console
from .common import JsonFlag, emit, pick_device, pick_dtype, stdout

Opt = typer.Option


def evaluate(
    model: Annotated[str, typer.Argument(help="Local folder, .gguf, hub id, 'smollm2-135m', or a converted model.")],
    compare: Annotated[str | None, Opt(help="Also evaluate this (source) model under the same protocol; one table.")] = None,
    data: Annotated[str, Opt(help="wiki | lee (built-in evaluation parts), a .txt/.jsonl PATH, or a dataset name[:config[:split]].")] = "wiki",
    seq_len: Annotated[int, Opt(help="Tokens per window.")] = 512,
    max_windows: Annotated[int | None, Opt(help="Evaluate at most this many windows.")] = None,
    stride: Annotated[int | None, Opt(help="Sliding-window protocol with this stride (default: non-overlapping).")] = None,
    text_field: Annotated[str, Opt(help="Field holding the text in JSONL / datasets.")] = "text",
    context: Annotated[int, Opt(help="Report the KV cache size at this many tokens.")] = 8192,
    report: Annotated[Path | None, Opt(help="Write report.json, report.md and PNG plots into this folder.")] = None,
    measure_cache: Annotated[int | None, Opt(
        "--measure-cache", help="Generate this many tokens and measure the cache bytes (default: 64 with --compare/--report, else 0)."
    )] = None,
    batch_size: Annotated[int, Opt(help="Windows per forward pass.")] = 4,
    dtype: Annotated[str, Opt(help="fp32 | bf16 | fp16.")] = "fp32",
    device: Annotated[str, Opt(help="auto | cpu | cuda.")] = "auto",
    as_json: JsonFlag = False,
) -> None:
    """Token-level perplexity, exp(mean NLL), over windows of the evaluation text, and the KV cache."""
    pick_dtype(dtype)  # fail early on a bad name
    if context < 1:
        raise ValueError(f"--context must be positive, got {context}")
    if measure_cache is None:
        measure_cache = 64 if (compare or report) else 0
    if measure_cache < 0:
        raise ValueError(f"--measure-cache must be 0 or more, got {measure_cache}")
    settings = EvalSettings(
        data=data, text_field=text_field, seq_len=seq_len, max_windows=max_windows, stride=stride,
        batch_size=batch_size, dtype=dtype, device=pick_device(device), context=context, measure_tokens=measure_cache,
    )
    evaluated = []
    if compare:
        evaluated.append(evaluate_model(compare, settings, role="source"))
    evaluated.append(evaluate_model(model, settings, role="model" if not compare else "converted",
                                    ids=evaluated[0].ids if compare else None))
    result = compare_report(evaluated, settings)
    files = write_compare_report(result, report) if report else {}

    entry = evaluated[-1].entry
    flat = {
        "model": model,
        "data": data,
        **evaluated[-1].ppl,
        "kv_elements_per_token_per_layer": entry["kv_elements_per_token_per_layer"],
        "kv_bytes_per_token": entry["kv_bytes_per_token"],
        "attention": entry["attention"],
        "context": context,
        "kv_bytes_at_context": entry["kv_bytes_at_context"],
    }
    if entry.get("measured_cache"):
        flat["measured_cache"] = entry["measured_cache"]
    if compare:
        flat["source"] = evaluated[0].entry
        flat["comparison"] = result["comparison"]
    if files:
        flat["report_files"] = {k: str(v) for k, v in files.items()}
    if as_json:
        flat["protocol_description"] = result["protocol"]["description"]
        emit(flat, True, "")
    elif compare or measure_cache:
        header, rows = compare_rows(result)
        table = Table(title="transmla eval", caption=f"protocol ({result['protocol']['name']}): "
                      f"{result['protocol']['description']}", caption_justify="left")
        for i, h in enumerate(header):
            table.add_column(h, style="bold" if i == 0 else None, overflow="fold")
        for r in rows:
            table.add_row(*r)
        stdout.print(table)
    else:
        emit({k: v for k, v in flat.items() if k != "report_files"}, False, "perplexity")
    if files:
        stderr_console.print(f"[dim]report written to {report}: {', '.join(Path(p).name for p in files.values())}[/dim]")
