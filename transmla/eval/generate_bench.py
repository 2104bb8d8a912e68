"""End-to-end generation benchmark: decode tokens/s and peak memory of a model against its source.

For each model (the converted MLA model first, then its source): load it, prefill B random
prompts of T tokens through a transformers ``DynamicCache``, then decode N tokens greedily one
step at a time, feeding back the argmax (the loop of ``measured_cache.measure_cache``, batched).
MLA models prefill with the expanded path and decode with the absorbed one (their cache holds
the latent and the shared rope key). A short untimed warm-up pass (a few prompt tokens, one
decode step, on a throwaway cache) runs first so the timed numbers leave out one-time costs.

Each row holds the timings, the bytes the cache really held (must equal the formula
``kv_bytes_per_token_per_layer * layers * (T + N) * B``) and, on CUDA, the peak memory
allocated (weights + cache + activations). Pure library: no printing beyond optional progress
lines on stderr.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

import torch

from ..dtypes import pick_device, torch_dtype
from ..mla.cache import cache_bytes
from .kv import kv_summary
from .report import environment

__all__ = ["bench_generate", "default_dtype", "find_recorded_source"]

WARMUP_PROMPT_TOKENS = 8  # prompt length of the untimed warm-up pass


def default_dtype(device: str) -> str:
    """The dtype name used when none is given: bf16 on a GPU, fp32 on the CPU."""
    return "bf16" if device == "cuda" else "fp32"


def _validate(batch: int, context: int, new_tokens: int, dtype: str) -> None:
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")
    if context < 1:
        raise ValueError(f"context must be at least 1, got {context}")
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be at least 1, got {new_tokens}")
    torch_dtype(dtype)  # ValueError on a bad name


def _check_positions(config, spec: str, context: int, new_tokens: int) -> None:
    """The prompt plus the generated tokens must fit the model's position range, when it has one."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit and context + new_tokens > limit:
        raise ValueError(
            f"context + new_tokens = {context + new_tokens} exceeds max_position_embeddings = {limit} of {spec}"
        )


def find_recorded_source(config) -> str | None:
    """The source model a converted MLA config records, when that path exists here; else None.

    ``convert`` records the source argument in ``mla["method"]["source"]``; a ``path`` in
    ``mla["source"]`` is accepted too.
    """
    from ..checkpoint.resolve import BUILTIN_MODELS

    mla = getattr(config, "mla", None) or {}
    candidates = [(mla.get("method") or {}).get("source"), (mla.get("source") or {}).get("path")]
    for spec in candidates:
        if isinstance(spec, str) and spec and (spec in BUILTIN_MODELS or Path(spec).expanduser().exists()):
            return spec
    return None


def _resolve_source(model: str, config, source: str | None) -> str | None:
    """The source to compare with: the one given, the one the MLA config records, or None."""
    from ..mla.model import is_mla_config

    if source is not None or not is_mla_config(config):
        return source
    found = find_recorded_source(config)
    if found is None:
        recorded = (config.mla.get("method") or {}).get("source")
        where = f" (it records {recorded!r}, not found here)" if recorded else ""
        raise ValueError(f"give --source: {model} is an MLA model with no source path on disk{where}")
    return found


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _set_mode(model, mode: str | None) -> None:
    """Set the MLA attention path ("expanded"/"absorbed"/"auto") of an MLA model; no-op for others."""
    from ..mla.model import is_mla_config, set_decode_mode

    if mode is not None and is_mla_config(model.config):
        set_decode_mode(model, mode)


def _generate(model, ids: torch.Tensor, new_tokens: int, mla: bool):
    """Prefill ``ids`` [B, T] into a fresh cache, then decode ``new_tokens`` greedy steps.

    Returns (cache, prefill_seconds, decode_seconds); the cache ends up holding T + new_tokens tokens.
    """
    from transformers import DynamicCache

    device = ids.device.type
    cache = DynamicCache(config=model.config)
    _set_mode(model, "expanded" if mla else None)
    _sync(device)
    t0 = time.perf_counter()
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)  # prefill: T tokens cached
    _sync(device)
    t1 = time.perf_counter()
    _set_mode(model, "absorbed" if mla else None)
    for _ in range(new_tokens):
        nxt = out.logits[:, -1:].argmax(-1)  # [B, 1] greedy
        out = model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
    _sync(device)
    t2 = time.perf_counter()
    return out.past_key_values, t1 - t0, t2 - t1


def _random_prompts(vocab_size: int, batch: int, context: int, seed: int, device: str) -> torch.Tensor:
    """Token ids [B, T] drawn uniformly from the vocabulary with a seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, context), generator=gen).to(device)  # [B, T]


def _bench_one(spec: str, batch: int, context: int, new_tokens: int, dtype: str, device: str,
               seed: int, progress: bool) -> dict[str, Any]:
    """Load one model, warm it up, time prefill + decode, measure its cache; one result row."""
    from ..checkpoint.resolve import load_model
    from ..mla.model import is_mla_config

    _status(progress, f"loading {spec} ({dtype}, {device})")
    model, _ = load_model(spec, dtype=torch_dtype(dtype), device=device)
    mla = is_mla_config(model.config)
    old_mode = model.config.mla.get("decode", "auto") if mla else None
    try:
        ids = _random_prompts(model.config.vocab_size, batch, context, seed, device)  # [B, T]
        with torch.inference_mode():
            _generate(model, ids[:, :WARMUP_PROMPT_TOKENS], 1, mla)  # untimed warm-up, throwaway cache
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            _status(progress, f"prefill {batch}x{context}, decode {new_tokens} steps")
            cache, prefill_s, decode_s = _generate(model, ids, new_tokens, mla)
        peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
        row = _row(spec, model, cache, batch, context, new_tokens, dtype, device, prefill_s, decode_s, peak)
        row["decode_mode"] = "absorbed" if mla else None
    finally:
        if mla:
            _set_mode(model, old_mode)
        del model
        _free(device)
    return row


def _row(spec, model, cache, batch, context, new_tokens, dtype, device, prefill_s, decode_s, peak) -> dict[str, Any]:
    """The result row of one benchmarked model."""
    kv = kv_summary(model.config, torch_dtype(dtype))
    per_token_layer = kv["kv_bytes_per_token_per_layer"]
    return {
        "model": spec,
        "attention": kv["attention"],
        "batch": batch,
        "context": context,
        "new_tokens": new_tokens,
        "dtype": dtype,
        "device": device,
        "prefill_seconds": prefill_s,
        "decode_seconds": decode_s,
        "decode_tokens_per_second": batch * new_tokens / decode_s,
        "ms_per_step": 1000 * decode_s / new_tokens,
        "kv_elements_per_token_per_layer": kv["kv_elements_per_token_per_layer"],
        "kv_bytes_per_token_per_layer": per_token_layer,
        "layers": kv["layers"],
        "cached_tokens": int(cache.get_seq_length()),
        "cache_bytes": cache_bytes(cache),
        "formula_cache_bytes": per_token_layer * kv["layers"] * (context + new_tokens) * batch,
        "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "peak_memory_bytes": peak,
    }


def _status(enabled: bool, text: str) -> None:
    if enabled:
        from ..progress import stderr_console

        stderr_console.print(f"[dim]{text}[/dim]")


def _compare(row: dict[str, Any], source_row: dict[str, Any]) -> None:
    """Add the model-vs-source ratios to ``row``."""
    row["speedup_vs_source"] = row["decode_tokens_per_second"] / source_row["decode_tokens_per_second"]
    row["cache_ratio_vs_source"] = row["cache_bytes"] / source_row["cache_bytes"]
    if row["peak_memory_bytes"] is not None and source_row["peak_memory_bytes"]:
        row["peak_memory_ratio_vs_source"] = row["peak_memory_bytes"] / source_row["peak_memory_bytes"]


def bench_generate(
    model: str,
    source: str | None = None,
    batch: int = 1,
    context: int = 512,
    new_tokens: int = 32,
    dtype: str | None = None,
    device: str = "auto",
    seed: int = 0,
    progress: bool = False,
) -> dict[str, Any]:
    """Decode speed and memory of ``model`` and its source: {"environment": ..., "rows": [...]}.

    ``source`` defaults to the one the MLA config records (when it exists on disk); a model that
    is not MLA is benchmarked alone unless a source is given. ``dtype`` defaults to bf16 on CUDA
    and fp32 on the CPU. The first row is ``model`` (with ``speedup_vs_source`` and
    ``cache_ratio_vs_source`` when there is a source), the second the source. Models are loaded
    one at a time; both get the same random prompts (``seed``).
    """
    from ..checkpoint.resolve import load_config

    device = pick_device(device)
    dtype = dtype or default_dtype(device)
    _validate(batch, context, new_tokens, dtype)
    config = load_config(model)
    source = _resolve_source(model, config, source)
    _check_positions(config, model, context, new_tokens)
    if source is not None:
        _check_positions(load_config(source), source, context, new_tokens)

    rows = [_bench_one(spec, batch, context, new_tokens, dtype, device, seed, progress)
            for spec in ([model] if source is None else [model, source])]
    if len(rows) == 2:
        _compare(rows[0], rows[1])
    return {"environment": environment(), "rows": rows}
