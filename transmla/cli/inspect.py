"""transmla inspect: architecture and KV-cache cost of a source or converted model."""

from __future__ import annotations

from typing import Annotated

import typer

from ..checkpoint.resolve import load_config
from ..eval.kv import kv_summary
from ..export.engines import engine_report, kernel_report
from .common import JsonFlag, emit, pick_dtype


def inspect(
    model: Annotated[str, typer.Argument(help="Local folder, .gguf, hub id, a built-in name (smollm2-135m, qwen2.5-coder-1.5b), or a converted model.")],
    dtype: Annotated[str | None, typer.Option(help="Cache dtype for byte counts (default: the model's).")] = None,
    context: Annotated[int | None, typer.Option(help="Also give the cache size at this many tokens.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Show layers, heads, attention kind and KV-cache elements/bytes per token."""
    config = load_config(model)
    info = kv_summary(config, pick_dtype(dtype) if dtype else None, context).to_dict()
    if config.model_type == "deepseek_v3":  # an export: which engines load it, and why not
        for engine, why in engine_report(config.to_dict()).items():
            info[f"loads in {engine}"] = "yes" if why is None else f"no: {why}"
    info.update(kernel_report(config))  # a converted model: which engine runs its attention fast, and why not
    emit({"model": model, **info}, as_json, "model")
