"""Evaluate models under one protocol, and sweep a conversion method over KV-cache budgets.

``evaluate_model`` is the one evaluation both ``transmla eval`` (with ``--compare``) and
``transmla sweep`` use: perplexity on a text, KV accounting at a context, and optionally the
cache measured after generating tokens. ``sweep`` converts the source at each budget through
``transmla.convert.api.convert`` (``ConvertOptions(kv_budget=...)``), evaluates each converted
model, and writes sweep.json, sweep.md and sweep.png (perplexity against the kept KV-cache
fraction, one line per method or setting, the source as a horizontal line).
"""

from __future__ import annotations

import gc
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.files import refuse_symlinks
from ..dtypes import torch_dtype
from ..messages import warn
from ..progress import progress_bar, stderr_console
from . import report as rep

__all__ = ["EvalSettings", "compare_report", "evaluate_model", "options_for", "parse_budgets", "sweep", "write_sweep"]



@dataclass
class EvalSettings:
    """One protocol for every model of a report or sweep."""

    data: str = "wiki"
    text_field: str = "text"
    seq_len: int = 512
    max_windows: int | None = None
    stride: int | None = None  # None: non-overlapping windows; else the sliding-window protocol
    batch_size: int = 4
    dtype: str = "fp32"
    device: str = "cpu"
    context: int | None = 8192  # KV bytes reported at this many tokens
    measure_tokens: int = 0  # generate this many tokens and measure the cache (0: skip)
    prompt_tokens: int = 32  # prompt for the measured cache: the first tokens of the text
    progress: bool = True

    def __post_init__(self) -> None:
        """Window settings checked before any model loads (one-line errors naming the option)."""
        if self.seq_len < 2:
            raise ValueError(f"--seq-len must be at least 2, got {self.seq_len}")
        if self.max_windows is not None and self.max_windows < 1:
            raise ValueError(f"--max-windows must be at least 1, got {self.max_windows}")
        if self.stride is not None and not 1 <= self.stride <= self.seq_len:
            raise ValueError(f"--stride must be between 1 and --seq-len ({self.seq_len}), got {self.stride}")
        if self.batch_size < 1:
            raise ValueError(f"--batch-size must be at least 1, got {self.batch_size}")
        torch_dtype(self.dtype)

    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Evaluated:
    entry: dict[str, Any]  # report.model_entry
    ids: torch.Tensor  # [N] the evaluation tokens
    ppl: dict[str, Any] = field(default_factory=dict)  # PerplexityResult.to_dict()


def evaluate_model(spec: str | Path, settings: EvalSettings, role: str = "model",
                   ids: torch.Tensor | None = None) -> Evaluated:
    """Load ``spec`` (source or converted), score the text, account for (and measure) its KV cache.

    ``ids`` [N], when given, must equal this model's own tokenization of the text (a comparison
    needs the same tokens): a model with another tokenizer is refused.
    """
    from ..checkpoint.resolve import load_model
    from ..data.texts import load_text
    from .kv import kv_summary
    from .measured_cache import measure_cache
    from .perplexity import perplexity, tokenize_text

    dtype = settings.torch_dtype()
    net, tokenizer = load_model(str(spec), dtype=dtype, device=settings.device)
    try:
        limit = getattr(net.config, "max_position_embeddings", None)
        if limit is not None and settings.seq_len > limit:
            warn(f"--seq-len {settings.seq_len} is longer than {spec}'s {limit} positions (max_position_embeddings): "
                 "perplexity past them measures extrapolation, not the model")
        own = tokenize_text(tokenizer, load_text(settings.data, part="eval", text_field=settings.text_field))  # [N]
        if ids is not None and not torch.equal(own, ids):
            raise ValueError(f"{spec} tokenizes the text differently from the model it is compared with")
        start, cpu = time.perf_counter(), time.process_time()
        result = perplexity(net, own, seq_len=settings.seq_len, max_windows=settings.max_windows,
                            stride=settings.stride, batch_size=settings.batch_size, progress=settings.progress)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
        measured = None
        if settings.measure_tokens > 0:
            prompt = own[: max(1, min(settings.prompt_tokens, own.numel()))]  # [P]
            measured = measure_cache(net, prompt, settings.measure_tokens).to_dict()
        kv = kv_summary(net.config, dtype, settings.context)
        entry = rep.model_entry(str(spec), role, kv, result.to_dict(), measured, seconds)
        entry["eval_cpu_seconds"] = cpu_seconds  # all threads of this process; wall time is inflated on a shared CPU
        if kv.get("method") is None and kv["attention"] == "MLA":
            entry["method"] = "mla"
        return Evaluated(entry, own, result.to_dict())
    finally:
        del net
        gc.collect()


def compare_report(evaluated: Sequence[Evaluated], settings: EvalSettings, command: str | None = None) -> dict[str, Any]:
    """The report of one or two models (the source first when comparing), one protocol."""
    models = [e.entry for e in evaluated]
    report: dict[str, Any] = {
        "protocol": rep.protocol_info(evaluated[0].ppl, settings.data, settings.text_field),
        "context": settings.context,
        "dtype": settings.dtype,
        "models": models,
        "comparison": rep.comparison(models[-1], models[0]) if len(models) == 2 else None,
        "settings": settings.to_dict(),
        "environment": rep.environment(),
        "command": command or rep.command_line(),
    }
    return report


# --- sweep ----------------------------------------------------------------------------------


def parse_budgets(text: str | Sequence[float]) -> list[float]:
    """'0.5,0.25,0.125' -> [0.5, 0.25, 0.125]; each in (0, 1]."""
    items = text if not isinstance(text, str) else [t for t in text.replace(" ", "").split(",") if t]
    out = []
    for t in items:
        try:
            b = float(t)
        except ValueError:
            raise ValueError(f"budgets must be numbers like 0.5,0.25,0.125, got {t!r}") from None
        if not 0 < b <= 1:
            raise ValueError(f"each budget is a fraction of the source cache in (0, 1], got {b:g}")
        out.append(b)
    if not out:
        raise ValueError("give at least one budget, e.g. --budgets 0.5,0.25,0.125")
    return out


# Options each method understands (ConvertOptions fields); others are not passed to it.
METHOD_OPTIONS = {
    "transmla": {"freqfold", "q_lora_rank", "propagate"},
    "mha2mla": {"rope_pairs", "rope_select", "svd", "svd_weighting", "propagate"},
}
COMMON_OPTIONS = {"calib", "calib_samples", "calib_seq_len", "seed", "dtype", "device"}


def method_overrides(method: str, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The ConvertOptions fields this method gets: the user's settings it understands."""
    allowed = METHOD_OPTIONS.get(method, set()) | COMMON_OPTIONS
    return {k: v for k, v in overrides.items() if v is not None and k in allowed}


def _setting_label(method: str, overrides: Mapping[str, Any]) -> str:
    """Non-default method settings, e.g. 'rope_select=2norm, svd_weighting=activation'."""
    from ..convert.options import ConvertOptions

    defaults = ConvertOptions()
    keys = METHOD_OPTIONS.get(method, set())
    merged = method_overrides(method, overrides)
    parts = [f"{k}={v}" for k, v in sorted(merged.items()) if k in keys and str(v) != str(getattr(defaults, k))]
    return ", ".join(parts)


def options_for(method: str, budget: float, overrides: Mapping[str, Any] | None = None):
    """The ConvertOptions of one sweep point (convert's defaults, then the user's settings)."""
    from ..convert.options import ConvertOptions

    return ConvertOptions(method=method, kv_budget=budget, force=True, **method_overrides(method, overrides or {}))


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
) -> dict[str, Any]:
    """Convert ``source`` with each method at each budget, evaluate, write the table and plot.

    Returns the sweep dict also written to ``out_dir/sweep.json``. Converted models are written
    to ``out_dir/models/<method>-<budget>`` and deleted after evaluation unless ``keep``.
    ``convert_fn`` replaces ``transmla.convert.api.convert`` (tests).
    """
    from ..convert.api import convert as api_convert
    from ..convert.methods import get_method

    settings = settings or EvalSettings()
    overrides = dict(convert_options or {})
    convert_fn = convert_fn or api_convert
    budgets = parse_budgets(budgets)
    methods = list(dict.fromkeys(methods))
    if not methods:
        raise ValueError("give at least one method")
    for m in methods:
        get_method(m)  # unknown names fail before any work
        if m == "lossless":
            raise ValueError("the lossless method has no budget to sweep (it keeps the whole cache)")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    refuse_symlinks(out_dir)
    models_dir = out_dir / "models"

    stderr_console.print(f"[bold]sweep[/bold]: evaluating the source model {source}")
    src = evaluate_model(source, settings, role="source")
    calib = {k: overrides.get(k) for k in ("calib", "calib_samples", "calib_seq_len", "seed") if overrides.get(k) is not None}
    from ..convert.options import ConvertOptions

    defaults = ConvertOptions()
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
        "source": src.entry,
        "rows": [],
        "settings": settings.to_dict(),
        "environment": rep.environment(),
        "command": command or rep.command_line(),
        "kept_models": keep,
    }
    tasks = [(m, b) for m in methods for b in budgets]
    for method, budget in progress_bar(tasks, "budgets", enabled=settings.progress):
        target = models_dir / f"{method}-{budget:g}"
        stderr_console.print(f"[bold]sweep[/bold]: {method} at {budget:g} of the source KV cache -> {target}")
        options = options_for(method, budget, overrides)
        start, cpu = time.perf_counter(), time.process_time()
        converted = convert_fn(source, target, options, progress=settings.progress)
        convert_seconds, convert_cpu = time.perf_counter() - start, time.process_time() - cpu
        ev = evaluate_model(target, settings, role="converted", ids=src.ids)
        e = ev.entry
        row = {
            "method": method,
            "setting": _setting_label(method, overrides),
            "budget": budget,
            "kv_elements_per_token_per_layer": e["kv_elements_per_token_per_layer"],
            "cache_fraction": e["kv_elements_per_token_per_layer"] / src.entry["kv_elements_per_token_per_layer"],
            "kv_lora_rank": e.get("kv_lora_rank"),
            "qk_rope_head_dim": e.get("qk_rope_head_dim"),
            "perplexity": e["perplexity"],
            "nll": e["nll"],
            "tokens": e["tokens"],
            "perplexity_change": e["perplexity"] - src.entry["perplexity"],
            "kv_bytes_per_token": e["kv_bytes_per_token"],
            "kv_bytes_at_context": e.get("kv_bytes_at_context"),
            "measured_cache": e.get("measured_cache"),
            "convert_seconds": convert_seconds,
            "convert_cpu_seconds": convert_cpu,
            "eval_seconds": e.get("eval_seconds"),
            "eval_cpu_seconds": e.get("eval_cpu_seconds"),
            "model_dir": str(target) if keep else None,
            "conversion": _conversion_meta(converted),
        }
        result["rows"].append(row)
        if not keep:
            shutil.rmtree(target, ignore_errors=True)
        rep.write_json(result, out_dir / "sweep.json")  # partial results survive an interruption
        stderr_console.print(
            f"[bold]sweep[/bold]: {method} {budget:g}: {row['kv_elements_per_token_per_layer']} elements/token/layer, "
            f"perplexity {row['perplexity']:.2f} (source {src.entry['perplexity']:.2f})"
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
    if isinstance(mla, Mapping):
        out.update({k: mla[k] for k in ("kv_lora_rank", "qk_rope_head_dim") if k in mla})
        method = mla.get("method")
        if isinstance(method, Mapping):  # the method's description, without per-layer detail
            out["method_meta"] = {k: v for k, v in method.items() if k not in ("layers", "options")}
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
    png = rep.plot_sweep(
        sweep_lines(result), src["perplexity"], out_dir / "sweep.png",
        title=f"{result['source_model']}: perplexity vs KV cache, training-free",
        source_label=f"source ({src['attention']}, {src['kv_elements_per_token_per_layer']} el./token/layer)",
        subtitle=f"{p['data']}: {p['tokens']:,} tokens, {p['name']} {p['seq_len']}-token windows",
    )
    js = rep.write_json(result, out_dir / "sweep.json")
    md = out_dir / "sweep.md"
    md.write_text(rep.render_sweep_markdown(result, str(png)))
    return {"json": js, "md": md, "png": png}
