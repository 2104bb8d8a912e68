"""transmla sweep: convert at several KV-cache budgets, evaluate each, table and plot."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ..convert.options import CalibrationOptions
from ..convert.registry import METHODS, budget_methods
from ..eval.choice_tasks import TASKS, ChoiceSettings
from ..eval.code_task import TASK as CODE_TASK
from ..eval.code_task import CodeSettings
from ..eval.settings import EvalSettings
from ..progress import stderr_console
from ..sweep import SHAPE_SETTINGS, parse_budgets
from ..sweep import sweep as run_sweep
from .common import JsonFlag, emit, stdout
from .evaluate import CODE_FLAGS, CODE_SHARED, TASK_FLAGS, either
from .options import given, merge_flags, schema_flags, with_flags

Opt = typer.Option
METHOD_HELP = " | ".join(budget_methods()) + ", or several comma-separated (one line each)."


def sweep(
    source: Annotated[str, typer.Argument(help="Local HF folder, .gguf file, hub id, or a built-in name (smollm2-135m, qwen2.5-coder-1.5b).")],
    out: Annotated[Path, Opt("--out", help="Folder for sweep.json, sweep.md, sweep.png (and models/ with --keep).")],
    method: Annotated[str, Opt(help=METHOD_HELP)] = "transmla",
    budgets: Annotated[str, Opt(help="Fractions of the source KV cache, comma-separated.")] = "0.5,0.25,0.125",
    keep: Annotated[bool, Opt("--keep", help="Keep the converted models under OUT/models/.")] = False,
    tasks: Annotated[str, Opt(help="Also score every model on these tasks, comma-separated: cloze, recall "
                                   "(accuracy), code (exact match of the greedy first line); see `transmla eval "
                                   "--task`; empty: perplexity only.")] = "",
    *,
    as_json: JsonFlag = False,
    settings: dict,
) -> None:
    """Convert SOURCE at each KV budget, evaluate every model under one protocol, plot perplexity vs cache."""
    methods = [m.strip() for m in method.split(",") if m.strip()]
    eval_settings = EvalSettings(**{k: settings[k] for k in EVAL_FIELDS})
    task_flags = given({k: settings.pop(k) for k in TASK_FIELDS})
    task_list = [t.strip() for t in tasks.split(",") if t.strip()]
    for k in task_flags:
        if not task_list:
            raise ValueError(f"--{k.replace('_', '-')} needs --tasks")
        if not set(task_list) & set(TASK_FLAGS[k]):
            raise ValueError(f"--{k.replace('_', '-')} applies to --tasks {either(TASK_FLAGS[k])} only")
    choice = ChoiceSettings(**{k: v for k, v in task_flags.items() if k in CHOICE_FIELDS}) \
        if set(task_list) & set(TASKS) else None
    code = CodeSettings(**{k: v for k, v in task_flags.items() if k in CODE_SHARED}) if CODE_TASK in task_list else None
    overrides = given({k: v for k, v in settings.items() if k not in EVAL_FIELDS} | {"device": settings["device"]})
    result = run_sweep(source, methods, parse_budgets(budgets), out, eval_settings, overrides, keep=keep,
                       tasks=task_list, task_settings=choice, code_settings=code)
    if as_json:
        emit(result, True, "")
        return
    src = result["source"]
    table = Table(title=f"sweep: {source}", caption=f"protocol ({result['protocol']['name']}): "
                  f"{result['protocol']['description']}", caption_justify="left")
    for h in ("method", "budget", "KV el./token/layer", "R + r", "perplexity", "vs source", *task_list):
        table.add_column(h)
    acc = lambda row: [f"{row['tasks'][t]:.1%}" for t in task_list]  # noqa: E731
    table.add_row("source", "1", str(src["kv_elements_per_token_per_layer"]), "–", f"{src['perplexity']:.2f}", "",
                  *acc(src))
    for r in result["rows"]:
        label = r["method"] + (f" ({r['setting']})" if r.get("setting") else "")
        table.add_row(label, f"{r['budget']:g}", str(r["kv_elements_per_token_per_layer"]),
                      f"{r.get('kv_lora_rank')} + {r.get('qk_rope_head_dim')}", f"{r['perplexity']:.2f}",
                      f"x{r['perplexity'] / src['perplexity']:.2f}", *acc(r))
    stdout.print(table)
    stderr_console.print(f"[dim]written: {out / 'sweep.json'}, {out / 'sweep.md'}, {out / 'sweep.png'}[/dim]")


EVAL_FIELDS = {f.name for f in schema_flags(EvalSettings)}
# Each method's own settings (its shape comes from --budgets) and the calibration, all "not given" by default.
CHOICE_FLAGS = schema_flags(ChoiceSettings, unset_default=True)
CHOICE_FIELDS = [f.name for f in CHOICE_FLAGS]
TASK_FIELDS = CHOICE_FIELDS + [f.name for f in CODE_FLAGS]
SWEEP_FLAGS = merge_flags(
    schema_flags(EvalSettings),
    CHOICE_FLAGS,
    CODE_FLAGS,
    *(schema_flags(m.Options, unset_default=True, exclude=SHAPE_SETTINGS) for m in METHODS.values()),
    schema_flags(CalibrationOptions, unset_default=True, exclude={"device"}),
)
sweep = with_flags(sweep, SWEEP_FLAGS)
