"""transmla convert: a source checkpoint in, an MLA checkpoint out.

The flags are the fields of the common conversion settings and of every method's Options
(convert/options.py, convert/registry.py); a method's flags default to "not given" (its own default).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..convert.api import convert as run_convert
from ..convert.options import COMMON_SCHEMAS, ConvertOptions
from ..convert.registry import METHODS
from ..export.engines import engine_shape_note
from .common import JsonFlag, emit
from .options import given, merge_flags, schema_flags, with_flags

Opt = typer.Option
METHOD_HELP = " | ".join(f"{m.name} ({m.help})" for m in METHODS.values())


def convert(
    source: Annotated[str, typer.Argument(help="Local HF folder, .gguf file, hub id, or a built-in name (smollm2-135m, qwen2.5-coder-1.5b).")],
    output: Annotated[Path, typer.Argument(help="Output folder (written atomically; must be empty unless --force).")],
    method: Annotated[str, Opt(help=METHOD_HELP + ".")] = "lossless",
    eval_data: Annotated[str | None, Opt(help="Print perplexity on this text after each stage of the method.")] = None,
    *,
    as_json: JsonFlag = False,
    settings: dict,
) -> None:
    """Convert a Llama/Qwen2/Mistral/Mixtral checkpoint into Multi-head Latent Attention."""
    options = ConvertOptions.of(method, **given(settings))
    stage_report = None
    if eval_data is not None:
        from ..eval.stages import stage_report as make_stage_report

        stage_report = make_stage_report(eval_data)
    result = run_convert(source, output, options, stage_report=stage_report)
    summary = {
        "output": result.output,
        "method": result.method,
        "layers": result.num_layers,
        "kv_lora_rank": result.mla.kv_lora_rank,
        "qk_rope_head_dim": result.mla.qk_rope_head_dim,
        "source_kv_elements_per_token_per_layer": result.source_kv_elements_per_token_per_layer,
        "kv_elements_per_token_per_layer": result.kv_elements_per_token_per_layer,
        "cache_ratio": result.cache_ratio,
        "files": len(result.files),
    }
    mla = result.mla
    if getattr(options.settings, "shared_rope", False) and not mla.qk_norm:  # a shape the engines load
        summary["engines"] = engine_shape_note(mla.kv_lora_rank, mla.qk_rope_head_dim, mla.qk_nope_head_dim,
                                               mla.v_head_dim, result.source_kv_elements_per_token_per_layer)
    emit(summary, as_json, "converted")


CONVERT_FLAGS = merge_flags(
    *(schema_flags(m.Options, unset_default=True) for m in METHODS.values()),
    *(schema_flags(s) for s in COMMON_SCHEMAS),
)
convert = with_flags(convert, CONVERT_FLAGS)
