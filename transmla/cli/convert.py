"""transmla convert: a source checkpoint in, an MLA checkpoint out."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..convert.api import convert as run_convert
from ..convert.options import ConvertOptions
from .common import JsonFlag, emit

Opt = typer.Option


def convert(
    source: Annotated[str, typer.Argument(help="Local HF folder, .gguf file, hub id, or the built-in 'smollm2-135m'.")],
    output: Annotated[Path, typer.Argument(help="Output folder (written atomically; must be empty unless --force).")],
    method: Annotated[str, Opt(help="lossless (exact, no saving) | transmla | mha2mla.")] = "lossless",
    kv_lora_rank: Annotated[int | None, Opt("--kv-lora-rank", "-R", help="Latent size d_c.")] = None,
    rope_dim: Annotated[int | None, Opt("--rope-dim", "-r", help="transmla: shared rope key dims d_r.")] = None,
    rope_pairs: Annotated[int | None, Opt("--rope-pairs", "-P", help="mha2mla: RoPE pairs kept per KV head.")] = None,
    kv_budget: Annotated[float | None, Opt(help="Fraction of the source KV cache to keep; derives -R/-r.")] = None,
    freqfold: Annotated[str, Opt(help="transmla: frequencies folded per PCA group: an integer, 'auto' (F = head_dim / rope-dim) or 'logit' (per layer, least expected logit error).")] = "auto",
    rope_select: Annotated[str, Opt(help="mha2mla: high | low | uniform | 2norm.")] = "high",
    svd: Annotated[str, Opt(help="mha2mla: joint | split low rank of [K_nope; V].")] = "joint",
    svd_weighting: Annotated[str, Opt(help="mha2mla: activation (whiten by the calibration input covariance; far better training-free) | none (weight-only SVD, as published).")] = "activation",
    q_lora_rank: Annotated[int | None, Opt(help="Low-rank query of this rank (PCA).")] = None,
    shared_rope: Annotated[bool, Opt("--shared-rope", help="transmla: one rope frequency grid in every layer (one component per FreqFold group, F = head_dim / rope-dim), the shape DeepSeek engines and llama.cpp run; see `transmla export`.")] = False,
    format: Annotated[str, Opt("--format", help="native (our MLA format) | deepseek (a stock DeepseekV3ForCausalLM folder; implies --shared-rope).")] = "native",
    calib: Annotated[str, Opt(help="Calibration text: wiki | lee | PATH | dataset name.")] = "wiki",
    calib_samples: Annotated[int | None, Opt(help="Calibration sequences (default: the method's own, 2048 for transmla and mha2mla).")] = None,
    calib_seq_len: Annotated[int | None, Opt(help="Tokens per calibration sequence (default: the method's own, 16 for transmla and mha2mla; many short sequences measured better than few long ones).")] = None,
    seed: Annotated[int, Opt(help="Seed for picking calibration sequences.")] = 0,
    propagate: Annotated[str | None, Opt(help="Calibrate later layers on 'original' or 'converted' earlier layers (default: original: measured better for transmla, and as published for mha2mla).")] = None,
    eval_data: Annotated[str | None, Opt(help="Print perplexity on this text after each stage.")] = None,
    dtype: Annotated[str | None, Opt(help="Output dtype: fp32 | bf16 | fp16 (default: the source's).")] = None,
    device: Annotated[str, Opt(help="auto | cpu | cuda, for the conversion math.")] = "auto",
    max_shard_size: Annotated[str, Opt(help="Largest safetensors shard, e.g. 5GB, 500MB.")] = "5GB",
    force: Annotated[bool, Opt("--force", help="Replace a non-empty output folder.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Convert a Llama/Qwen2/Mistral/Mixtral checkpoint into Multi-head Latent Attention."""
    options = ConvertOptions(
        method=method, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim, rope_pairs=rope_pairs, kv_budget=kv_budget,
        freqfold=freqfold, rope_select=rope_select, svd=svd, svd_weighting=svd_weighting, q_lora_rank=q_lora_rank,
        shared_rope=shared_rope, format=format,
        calib=calib, calib_samples=calib_samples, calib_seq_len=calib_seq_len, seed=seed, propagate=propagate,
        eval_data=eval_data, dtype=dtype, device=device, max_shard_size=max_shard_size, force=force,
    )
    result = run_convert(source, output, options)
    summary = {
        "output": result.output,
        "method": result.method,
        "layers": result.num_layers,
        "kv_lora_rank": result.mla["kv_lora_rank"],
        "qk_rope_head_dim": result.mla["qk_rope_head_dim"],
        "source_kv_elements_per_token_per_layer": result.source_kv_elements_per_token_per_layer,
        "kv_elements_per_token_per_layer": result.kv_elements_per_token_per_layer,
        "cache_ratio": result.cache_ratio,
        "files": len(result.files),
    }
    emit(summary, as_json, "converted")
