"""transmla export: a converted model written for other engines (DeepSeek-V3 folder, llama.cpp GGUF)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..checkpoint.resolve import resolve_model_dir
from ..export.deepseek import export_deepseek
from ..export.gguf import GGUF_TYPES, export_gguf
from ..export.options import ExportOptions
from .common import JsonFlag, emit
from .options import schema_flags, with_flags

Opt = typer.Option
FORMATS = ("deepseek", "gguf")


def export(
    model: Annotated[str, typer.Argument(help="A converted (native MLA) model folder.")],
    output: Annotated[Path, typer.Argument(help="Output folder, or the .gguf file for --format gguf (written atomically; must not exist unless --force).")],
    format: Annotated[str, Opt("--format", help="deepseek: a stock DeepseekV3ForCausalLM folder (transformers, vLLM, SGLang); gguf: a llama.cpp `deepseek2` GGUF file (llama.cpp, Ollama).")] = "deepseek",
    gguf_type: Annotated[str, Opt("--type", help=f"gguf: weight type, {' | '.join(GGUF_TYPES)} (norms stay f32; the scaled latent rows never q8_0).")] = "f32",
    tokenizer_pre: Annotated[str | None, Opt("--tokenizer-pre", help="gguf: llama.cpp's pre-tokenizer name (tokenizer.ggml.pre), when it cannot be read from tokenizer.json.")] = None,
    *,
    as_json: JsonFlag = False,
    settings: dict,
) -> None:
    """Export a converted model so stock engines run it without this package (no remote code)."""
    if format not in FORMATS:
        raise ValueError(f"--format must be one of {', '.join(FORMATS)}, got {format!r}")
    if format == "gguf":  # of the export settings, only these two apply to a GGUF file
        drop_biases = settings["drop_biases"]
        gguf = export_gguf(resolve_model_dir(model), output, gguf_type, tokenizer_pre, drop_biases=drop_biases,
                           force=settings["force"])
        emit({"output": str(gguf.path), "format": "gguf (llama.cpp deepseek2)", "type": gguf.weight_type,
              "tokenizer_pre": gguf.tokenizer_pre, "kv_elements_per_token_per_layer": gguf.cache_elements,
              "tensors": gguf.tensors, "bytes": gguf.bytes, "dropped_biases": drop_biases}, as_json, "exported")
        return
    options = ExportOptions(**settings)
    options.refuse_fp16()
    result = export_deepseek(resolve_model_dir(model), output, options)
    summary = {
        "output": result.output,
        "format": result.format,
        "kv_elements_per_token_per_layer": result.kv_elements_per_token_per_layer,
        "padded_latent": result.record["padded_latent"],
        "dropped_biases": result.record["dropped_biases"],
        "rms_norm_eps": f"{result.record['source_rms_norm_eps']} -> 1e-06" if result.record["rms_norm_eps_changed"] else "1e-06",
        **{f"loads in {e}": "yes" if why is None else f"no: {why}" for e, why in result.engines.items()},
        "files": len(result.files),
    }
    emit(summary, as_json, "exported")


export = with_flags(export, schema_flags(ExportOptions))
