"""Sweep conversion methods over KV-cache budgets: convert, evaluate, table and plot.

Sits above convert and eval: ``sweep`` converts the source at each budget through
``transmla.convert.api.convert`` (each method's own settings, ``kv_budget`` set per point),
evaluates each converted model with ``eval.evaluate.evaluate_model``, and writes sweep.json,
sweep.md and sweep.png (perplexity against the kept KV-cache fraction, one line per method or
setting, the source as a horizontal line).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from .checkpoint.files import refuse_symlinks
from .convert.api import convert as api_convert
from .convert.budget import check_kv_budget
from .convert.options import COMMON_SCHEMAS, ConvertOptions
from .convert.registry import budget_methods, get_method
from .mla.config import MLAConfig
from .eval import report as rep
from .eval.choice_tasks import TASKS, ChoiceSettings, evaluate_choices
from .eval.code_task import TASK as CODE_TASK
from .eval.code_task import CodeSettings, evaluate_code
from .eval.evaluate import evaluate_model
from .eval.measured_cache import MeasuredCache
from .eval.plots import plot_sweep
from .eval.settings import EvalSettings
from .eval.sweep_report import render_sweep_markdown
from .machine import environment
from .progress import progress_bar, stderr_console

__all__ = ["SWEEP_TASKS", "SweepRow", "options_for", "parse_budgets", "sweep", "write_sweep"]

# The tasks `sweep --tasks` scores beside perplexity, and the one number each gives a row.
SWEEP_TASKS = {**{t: "acc" for t in TASKS}, CODE_TASK: "exact_match"}


def parse_budgets(text: str | Sequence[float]) -> list[float]:
    """'0.5,0.25,0.125' -> [0.5, 0.25, 0.125]; each in (0, 1) (convert.budget)."""
    items = text if not isinstance(text, str) else [t for t in text.replace(" ", "").split(",") if t]
    out = []
    for t in items:
        try:
            b = float(t)
        except ValueError:
            raise ValueError(f"budgets must be numbers like 0.5,0.25,0.125, got {t!r}") from None
        check_kv_budget(b)
        out.append(b)
    if not out:
        raise ValueError("give at least one budget, e.g. --budgets 0.5,0.25,0.125")
    return out


# The budget is set per point; the shape settings it derives cannot be given beside it.
SHAPE_SETTINGS = {"kv_budget", "kv_lora_rank", "rope_dim"}
COMMON_SETTINGS = {f.name for s in COMMON_SCHEMAS for f in fields(s)}


def _method_settings(method: str) -> dict[str, Any]:
    """This method's own settings (not the shape) and their defaults."""
    return {f.name: f.default for f in fields(get_method(method).Options) if f.name not in SHAPE_SETTINGS}


def method_overrides(method: str, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The settings this method gets: the user's settings it (or every method) understands."""
    allowed = set(_method_settings(method)) | COMMON_SETTINGS
    return {k: v for k, v in overrides.items() if v is not None and k in allowed}


def _setting_label(method: str, overrides: Mapping[str, Any]) -> str:
    """Non-default method settings, e.g. 'rope_select=2norm, svd_weighting=none'."""
    own = _method_settings(method) | {"propagate": get_method(method).default_propagate}
    merged = method_overrides(method, overrides)
    parts = [f"{k}={v}" for k, v in sorted(merged.items()) if k in own and str(v) != str(own[k])]
    return ", ".join(parts)


def options_for(method: str, budget: float, overrides: Mapping[str, Any] | None = None) -> ConvertOptions:
    """The ConvertOptions of one sweep point (the method's defaults, then the user's settings)."""
    return ConvertOptions.of(method, kv_budget=budget, force=True, **method_overrides(method, overrides or {}))


@dataclass
class SweepRow:
    """One converted model of a sweep; a dict (to_dict, sweep.json's key order) only when written."""

    method: str
    setting: str  # non-default method settings, "" for the defaults
    budget: float
    kv_elements_per_token_per_layer: int
    cache_fraction: float
    kv_lora_rank: int | None
    qk_rope_head_dim: int | None
    perplexity: float
    nll: float
    tokens: int
    perplexity_change: float
    kv_bytes_per_token: int
    kv_bytes_at_context: int | None
    measured_cache: MeasuredCache | None
    convert_seconds: float
    convert_cpu_seconds: float
    eval_seconds: float | None
    eval_cpu_seconds: float | None
    model_dir: str | None
    conversion: dict[str, Any] | None  # _conversion_meta
    tasks: dict[str, float] | None = None  # each task's score (--tasks; SWEEP_TASKS), absent without

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "tasks" or self.tasks is not None}
        if self.measured_cache is not None:
            out["measured_cache"] = self.measured_cache.to_dict()
        return out


def sweep(
    source: str,
    methods: Sequence[str],
    budgets: Sequence[float],
    out_dir: str | Path,
    settings: EvalSettings | None = None,
    convert_options: Mapping[str, Any] | None = None,
    keep: bool = False,
    command: str | None = None,
    convert_fn: Callable | None = None,
    tasks: Sequence[str] = (),
    task_settings: ChoiceSettings | None = None,
    code_settings: CodeSettings | None = None,
) -> dict[str, Any]:
    """Convert ``source`` with each method at each budget, evaluate, write the table and plot.

    Returns the sweep dict also written to ``out_dir/sweep.json``. Converted models are written
    to ``out_dir/models/<method>-<budget>`` and deleted after evaluation unless ``keep``.
    ``convert_fn`` replaces ``transmla.convert.api.convert`` (tests). ``tasks`` (cloze, recall, code)
    scores every model on those tasks too, beside its perplexity: the multiple-choice tasks' accuracy
    (eval/choice_tasks.py, ``task_settings``) and the code task's exact match (eval/code_task.py,
    ``code_settings``).
    """
    settings = settings or EvalSettings()
    overrides = dict(convert_options or {})
    convert_fn = convert_fn or api_convert
    budgets = parse_budgets(budgets)
    methods = list(dict.fromkeys(methods))
    if not methods:
        raise ValueError("give at least one method")
    for m in methods:
        get_method(m)  # unknown names fail before any work
        if m not in budget_methods():
            raise ValueError(f"the {m} method has no budget to sweep (it keeps the whole cache)")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    refuse_symlinks(out_dir)
    models_dir = out_dir / "models"

    tasks = list(dict.fromkeys(tasks))
    for t in tasks:
        if t not in SWEEP_TASKS:
            raise ValueError(f"tasks must be among {', '.join(SWEEP_TASKS)}, got {t!r}")
    task_settings = task_settings or ChoiceSettings()
    code_settings = code_settings or CodeSettings()

    def task_score(spec: str, role: str, task: str) -> float:
        run = dict(dtype=settings.torch_dtype(), device=settings.device, role=role, progress=settings.progress)
        if task == CODE_TASK:
            return evaluate_code(spec, code_settings, **run)[SWEEP_TASKS[task]]
        return evaluate_choices(spec, task, task_settings, **run)[SWEEP_TASKS[task]]

    def task_scores(spec: str, role: str) -> dict[str, float] | None:
        return {t: task_score(spec, role, t) for t in tasks} if tasks else None

    stderr_console.print(f"[bold]sweep[/bold]: evaluating the source model {source}")
    src = evaluate_model(source, settings, role="source")
    src_tasks = task_scores(source, "source")
    calib = {k: overrides.get(k) for k in ("calib", "calib_samples", "calib_seq_len", "seed") if overrides.get(k) is not None}
    defaults = ConvertOptions().calibration
    calib_text = ", ".join(
        f"{k}={calib.get(k, getattr(defaults, k) if getattr(defaults, k) is not None else 'method default')}"
        for k in ("calib", "calib_samples", "calib_seq_len", "seed")
    )
    result: dict[str, Any] = {
        "source_model": source,
        "methods": methods,
        "budgets": budgets,
        "protocol": rep.protocol_info(src.ppl, settings.data, settings.text_field),
        "dtype": settings.dtype,
        "calibration": calib_text + " (used by the settings that calibrate)",
        "convert_options": overrides,
        "source": src.entry.to_dict() | ({"tasks": src_tasks} if tasks else {}),
        "rows": [],
        "settings": settings.to_dict(),
        "environment": environment(),
        "command": command or rep.command_line(),
        "kept_models": keep,
    }
    if tasks:
        result["task_scores"] = {t: SWEEP_TASKS[t] for t in tasks}  # what each task's number is
    if set(tasks) & set(TASKS):
        result["task_settings"] = task_settings.to_dict()
    if CODE_TASK in tasks:
        result["code_settings"] = code_settings.to_dict()
    points = [(m, b) for m in methods for b in budgets]
    for method, budget in progress_bar(points, "budgets", enabled=settings.progress):
        target = models_dir / f"{method}-{budget:g}"
        stderr_console.print(f"[bold]sweep[/bold]: {method} at {budget:g} of the source KV cache -> {target}")
        options = options_for(method, budget, overrides)
        start, cpu = time.perf_counter(), time.process_time()
        converted = convert_fn(source, target, options, progress=settings.progress)
        convert_seconds, convert_cpu = time.perf_counter() - start, time.process_time() - cpu
        ev = evaluate_model(target, settings, role="converted", ids=src.ids)
        e = ev.entry
        row = SweepRow(
            method=method,
            setting=_setting_label(method, overrides),
            budget=budget,
            kv_elements_per_token_per_layer=e.kv_elements_per_token_per_layer,
            cache_fraction=e.kv_elements_per_token_per_layer / src.entry.kv_elements_per_token_per_layer,
            kv_lora_rank=e.kv_lora_rank,
            qk_rope_head_dim=e.qk_rope_head_dim,
            perplexity=e.perplexity,
            nll=e.nll,
            tokens=e.tokens,
            perplexity_change=e.perplexity - src.entry.perplexity,
            kv_bytes_per_token=e.kv_bytes_per_token,
            kv_bytes_at_context=e.kv_bytes_at_context,
            measured_cache=e.measured_cache,
            convert_seconds=convert_seconds,
            convert_cpu_seconds=convert_cpu,
            eval_seconds=e.eval_seconds,
            eval_cpu_seconds=e.eval_cpu_seconds,
            model_dir=str(target) if keep else None,
            conversion=_conversion_meta(converted),
            tasks=task_scores(str(target), "converted"),
        )
        result["rows"].append(row.to_dict())
        if not keep:
            shutil.rmtree(target, ignore_errors=True)
        rep.write_json(result, out_dir / "sweep.json")  # partial results survive an interruption
        stderr_console.print(
            f"[bold]sweep[/bold]: {method} {budget:g}: {row.kv_elements_per_token_per_layer} elements/token/layer, "
            f"perplexity {row.perplexity:.2f} (source {src.entry.perplexity:.2f})"
        )
    if models_dir.is_dir() and not any(models_dir.iterdir()):
        models_dir.rmdir()
    write_sweep(result, out_dir)
    return result


def _conversion_meta(converted: Any) -> dict[str, Any] | None:
    """What the conversion reported (method name, ranks, ...), small and JSON-safe."""
    if converted is None:
        return None
    out = {}
    for key in ("method", "kv_elements_per_token_per_layer", "source_kv_elements_per_token_per_layer", "cache_ratio"):
        if hasattr(converted, key):
            out[key] = getattr(converted, key)
    mla = getattr(converted, "mla", None)
    if isinstance(mla, MLAConfig):
        out.update(kv_lora_rank=mla.kv_lora_rank, qk_rope_head_dim=mla.qk_rope_head_dim)
        if isinstance(mla.method, Mapping):  # the method's description, without per-layer detail
            out["method_meta"] = {k: v for k, v in mla.method.items() if k not in ("layers", "options")}
    return out


def sweep_lines(result: Mapping[str, Any]) -> dict[str, list[tuple[float, float]]]:
    lines: dict[str, list[tuple[float, float]]] = {}
    for r in result["rows"]:
        label = r["method"] + (f" ({r['setting']})" if r.get("setting") else "")
        lines.setdefault(label, []).append((r["cache_fraction"], r["perplexity"]))
    return lines


def write_sweep(result: Mapping[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """sweep.json, sweep.md and sweep.png in out_dir."""
    out_dir = Path(out_dir)
    src = result["source"]
    p = result["protocol"]
    png = plot_sweep(
        sweep_lines(result), src["perplexity"], out_dir / "sweep.png",
        title=f"{result['source_model']}: perplexity vs KV cache, training-free",
        source_label=f"source ({src['attention']}, {src['kv_elements_per_token_per_layer']} el./token/layer)",
        subtitle=f"{p['data']}: {p['tokens']:,} tokens, {p['name']} {p['seq_len']}-token windows",
    )
    js = rep.write_json(result, out_dir / "sweep.json")
    md = out_dir / "sweep.md"
    md.write_text(render_sweep_markdown(result, str(png)))
    return {"json": js, "md": md, "png": png}
