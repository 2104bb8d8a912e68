"""transmla export: a converted model written for other engines (DeepSeek-V3 folder, llama.cpp GGUF)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..checkpoint.resolve import resolve_model_dir
from ..export.deepseek import ExportOptions, export_deepseek
from ..export.engines import parse_engines
from ..export.gguf import GGUF_TYPES, export_gguf
from .common import JsonFlag, emit

Opt = typer.Option
FORMATS = ("deepseek", "gguf")


def export(
    model: Annotated[str, typer.Argument(help="A converted (native MLA) model folder.")],
    output: Annotated[Path, typer.Argument(help="Output folder, or the .gguf file for --format gguf (written atomically; must not exist unless --force).")],
    format: Annotated[str, Opt("--format", help="deepseek: a stock DeepseekV3ForCausalLM folder (transformers, vLLM, SGLang); gguf: a llama.cpp `deepseek2` GGUF file (llama.cpp, Ollama).")] = "deepseek",
    gguf_type: Annotated[str, Opt("--type", help=f"gguf: weight type, {' | '.join(GGUF_TYPES)} (norms stay f32; the scaled latent rows never q8_0).")] = "f32",
    tokenizer_pre: Annotated[str | None, Opt("--tokenizer-pre", help="gguf: llama.cpp's pre-tokenizer name (tokenizer.ggml.pre), when it cannot be read from tokenizer.json.")] = None,
    engines: Annotated[str, Opt(help="Engines the export must load in exactly, comma-separated: transformers, vllm, sglang or all. Their rules are checked; `transmla inspect OUTPUT` reports every engine.")] = "transformers",
    pad_latent: Annotated[bool, Opt("--pad-latent", help="Zero-pad the latent so kv_lora_rank + qk_rope_head_dim is a width vLLM accepts (320 or 576): exact, but the cache grows to that width.")] = False,
    drop_biases: Annotated[bool, Opt("--drop-biases", help="Drop attention biases for engines without them (vLLM, SGLang): lossy, measure it.")] = False,
    dtype: Annotated[str | None, Opt(help="fp32 | bf16 (default: the model's; fp16 underflows the latent-norm scaling).")] = None,
    max_shard_size: Annotated[str, Opt(help="Largest safetensors shard, e.g. 5GB, 500MB.")] = "5GB",
    force: Annotated[bool, Opt("--force", help="Replace a non-empty output folder.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Export a converted model so stock engines run it without this package (no remote code)."""
    if format not in FORMATS:
        raise ValueError(f"--format must be one of {', '.join(FORMATS)}, got {format!r}")
    if format == "gguf":
        gguf = export_gguf(resolve_model_dir(model), output, gguf_type, tokenizer_pre, drop_biases=drop_biases, force=force)
        emit({"output": str(gguf.path), "format": "gguf (llama.cpp deepseek2)", "type": gguf.weight_type,
              "tokenizer_pre": gguf.tokenizer_pre, "kv_elements_per_token_per_layer": gguf.cache_elements,
              "tensors": gguf.tensors, "bytes": gguf.bytes, "dropped_biases": drop_biases}, as_json, "exported")
        return
    options = ExportOptions(
        engines=parse_engines(engines), pad_latent=pad_latent,
        drop_biases=drop_biases, dtype=dtype, max_shard_size=max_shard_size, force=force,
    )
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
