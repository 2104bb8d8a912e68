"""transmla eval: perplexity and KV cache of a model (or a task: passkey retrieval, cloze, recall, code
completion), alone or against its source, with a report."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ..eval.report import compare_rows, write_compare_report
from ..eval.evaluate import compare_report, evaluate_model
from ..eval.choice_tasks import TASKS, ChoiceSettings
from ..eval.code_task import TASK as CODE_TASK
from ..eval.code_task import CodeSettings
from ..eval.passkey import PasskeySettings
from ..eval.settings import EvalSettings
from ..progress import stderr_console
from .common import JsonFlag, emit, stdout
from .options import merge_flags, schema_flags, with_flags

Opt = typer.Option


def evaluate(
    model: Annotated[str, typer.Argument(help="Local folder, .gguf, hub id, a built-in name (smollm2-135m, qwen2.5-coder-1.5b), or a converted model.")],
    compare: Annotated[str | None, Opt(help="Also evaluate this (source) model under the same protocol; one table.")] = None,
    report: Annotated[Path | None, Opt(help="Write report.json, report.md and PNG plots into this folder.")] = None,
    task: Annotated[str, Opt(help="perplexity | passkey (a 5-digit key hidden in filler text, found or not by "
                                  "the greedy answer, per prompt length x depth) | cloze (the true next sentence of "
                                  "held-out prose among others, by log-likelihood) | recall (where a person named "
                                  "once before long filler lives, among the cities named) | code (held-out Python "
                                  "stdlib functions: the body's NLL per token, the greedy first line, the true body "
                                  "among others).")] = "perplexity",
    *,
    as_json: JsonFlag = False,
    settings: dict,
) -> None:
    """Token-level perplexity, exp(mean NLL), over windows of the evaluation text, and the KV cache;
    or a task (--task passkey | cloze | recall | code)."""
    if task not in ALL_TASKS:
        raise ValueError(f"--task must be {either(ALL_TASKS)}, got {task!r}")
    flags = {k: settings.pop(k) for k in TASK_FLAGS}
    for k, v in flags.items():
        if v is not None and task not in TASK_FLAGS[k]:
            raise ValueError(f"--{k.replace('_', '-')} applies to --task {either(TASK_FLAGS[k])} only")
    given = {k: v for k, v in flags.items() if v is not None}
    if report is not None and task not in ("perplexity", "passkey"):
        raise ValueError(f"--report applies to --task perplexity or passkey only; --task {task} prints its table "
                         "(--json for the numbers)")
    if task != "perplexity":
        settings = EvalSettings(**settings | {"measure_tokens": 0})
    if task in TASKS:
        return _choices(model, compare, task, as_json, settings, ChoiceSettings(**given))
    if task == CODE_TASK:
        return _code(model, compare, as_json, settings, CodeSettings(**given))
    if task == "passkey":
        return _passkey(model, compare, report, as_json, settings, PasskeySettings(**given))
    if settings["measure_tokens"] is None:
        settings["measure_tokens"] = 64 if (compare or report) else 0
    settings = EvalSettings(**settings)
    data, context, measure_cache = settings.data, settings.context, settings.measure_tokens
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
        **evaluated[-1].ppl.to_dict(),
        "kv_elements_per_token_per_layer": entry.kv_elements_per_token_per_layer,
        "kv_bytes_per_token": entry.kv_bytes_per_token,
        "attention": entry.attention,
        "context": context,
        "kv_bytes_at_context": entry.kv_bytes_at_context,
    }
    if entry.measured_cache is not None:
        flat["measured_cache"] = entry.measured_cache.to_dict()
    if compare:
        flat["source"] = evaluated[0].entry.to_dict()
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


def either(names) -> str:
    """'a', 'a or b', 'a, b or c'."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _passkey(model: str, compare: str | None, report: Path | None, as_json: bool, settings: EvalSettings,
             passkey: PasskeySettings) -> None:
    """transmla eval --task passkey: the cells of the model (and its source), a table, the report."""
    from ..eval.passkey import evaluate_passkey, passkey_lengths, passkey_rows, write_passkey_report
    from ..eval.report import command_line
    from ..machine import environment

    runs = ([(compare, "source")] if compare else []) + [(model, "converted" if compare else "model")]
    lengths = [passkey_lengths(spec, passkey) for spec, _ in runs]  # every length checked before any model loads
    entries = [evaluate_passkey(spec, passkey, dtype=settings.torch_dtype(), device=settings.device, role=role,
                                progress=settings.progress, lengths=n) for (spec, role), n in zip(runs, lengths)]
    result = {"task": "passkey", "settings": passkey.to_dict(), "dtype": settings.dtype, "models": entries,
              "environment": environment(), "command": command_line()}
    files = write_passkey_report(result, report) if report else {}
    if files:
        result["report_files"] = {k: str(v) for k, v in files.items()}
    if as_json:
        emit(result, True, "")
    else:
        header, rows = passkey_rows(entries)
        table = Table(title="transmla eval --task passkey", caption="found / keys per prompt length x key depth "
                      "(greedy answer through the model's cache); s: seconds per cell", caption_justify="left")
        for i, h in enumerate(header):
            table.add_column(h, style="bold" if i < 2 else None)
        for r in rows:
            table.add_row(*r)
        stdout.print(table)
    if files:
        stderr_console.print(f"[dim]report written to {report}: {', '.join(Path(p).name for p in files.values())}[/dim]")


def _choices(model: str, compare: str | None, task: str, as_json: bool, settings: EvalSettings,
             choice: ChoiceSettings) -> None:
    """transmla eval --task cloze|recall: accuracy of the model (and its source) on the same items."""
    from ..eval.choice_tasks import evaluate_choices

    runs = ([(compare, "source")] if compare else []) + [(model, "converted" if compare else "model")]
    entries = [evaluate_choices(spec, task, choice, dtype=settings.torch_dtype(), device=settings.device, role=role,
                                progress=settings.progress) for spec, role in runs]
    result = {"task": task, "settings": choice.to_dict(), "dtype": settings.dtype, "models": entries}
    if as_json:
        emit(result, True, "")
        return
    table = Table(title=f"transmla eval --task {task}", caption=f"{choice.items} items, {choice.choices} choices "
                  f"(chance {1 / choice.choices:.0%}); acc: highest log-likelihood, acc_norm: per character; nll: "
                  f"-log of the true candidate's share of the likelihood (lower is better; {math.log(choice.choices):.2f} "
                  "at chance)", caption_justify="left")
    for h in ("model", "role", "acc", "acc_norm", "nll", "seconds"):
        table.add_column(h, style="bold" if h == "model" else None)
    for e in entries:
        table.add_row(e["model"], e["role"], f"{e['acc']:.1%}", f"{e['acc_norm']:.1%}", f"{e['nll']:.3f}", f"{e['seconds']:.0f}")
    stdout.print(table)


def _code(model: str, compare: str | None, as_json: bool, settings: EvalSettings, code: CodeSettings) -> None:
    """transmla eval --task code: the held-out stdlib functions scored on the model (and its source)."""
    from ..eval.code_task import evaluate_code

    runs = ([(compare, "source")] if compare else []) + [(model, "converted" if compare else "model")]
    entries = [evaluate_code(spec, code, dtype=settings.torch_dtype(), device=settings.device, role=role,
                             progress=settings.progress) for spec, role in runs]
    result = {"task": CODE_TASK, "settings": code.to_dict(), "dtype": settings.dtype, "models": entries}
    if as_json:
        emit(result, True, "")
        return
    choice = code.choices > 1
    table = Table(title=f"transmla eval --task {CODE_TASK}", caption=(
        f"{code.items} held-out Python {entries[0]['python']} stdlib functions, prompt: up to {code.context_tokens} "
        f"tokens of module text + signature + docstring; nll: per body token (at most {code.body_tokens}); exact: "
        "the greedy first body line" + (f"; acc: the true body among {code.choices} by log-likelihood "
                                        f"(chance {1 / code.choices:.0%}), acc_norm: per character" if choice else "")),
        caption_justify="left")
    for h in ("model", "role", "nll", "exact", *(("acc", "acc_norm") if choice else ()), "seconds"):
        table.add_column(h, style="bold" if h == "model" else None)
    for e in entries:
        table.add_row(e["model"], e["role"], f"{e['nll']:.4f}", f"{e['exact_match']:.1%}",
                      *((f"{e['acc']:.1%}", f"{e['acc_norm']:.1%}") if choice else ()), f"{e['seconds']:.0f}")
    stdout.print(table)


# The protocol's flags; --measure-cache defaults to 64 with --compare/--report, else 0. The passkey
# flags default to None (not given): --task perplexity refuses them, --task passkey fills in its defaults.
EVAL_FLAGS = [
    dataclasses.replace(f, type=int | None, default=None, help=f.help.replace(
        "(0: skip)", "(default: 64 with --compare/--report, else 0)")) if f.name == "measure_tokens" else f
    for f in schema_flags(EvalSettings)
]
PASSKEY_FLAGS = schema_flags(PasskeySettings, unset_default=True)
CHOICE_FLAGS = schema_flags(ChoiceSettings, unset_default=True)
CODE_FLAGS = schema_flags(CodeSettings, unset_default=True)
ALL_TASKS = ("perplexity", "passkey", *TASKS, CODE_TASK)
CODE_SHARED = {f.name for f in dataclasses.fields(CodeSettings)}
# Each task's own flags -> the tasks they apply to (the code task shares the choice tasks' --items,
# --choices, --context-tokens and --task-seed).
TASK_FLAGS = ({f.name: ("passkey",) for f in PASSKEY_FLAGS}
              | {f.name: TASKS + ((CODE_TASK,) if f.name in CODE_SHARED else ()) for f in CHOICE_FLAGS}
              | {f.name: (CODE_TASK,) for f in CODE_FLAGS})
evaluate = with_flags(evaluate, merge_flags(EVAL_FLAGS, PASSKEY_FLAGS, CHOICE_FLAGS, CODE_FLAGS))
