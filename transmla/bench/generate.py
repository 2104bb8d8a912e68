"""End-to-end generation benchmark: decode tokens/s, prefill time and cache of a model against its source.

For each model (the converted MLA model first, then its source): load it, fill a cache with B
prompts of T tokens, then decode N tokens greedily one step at a time, feeding back the argmax
(what ``generate()`` does), ``repeats`` times; min and median are kept. Each model runs the way
it runs best here:
- an MLA model with its own LatentCache (preallocated for T + N tokens, as ``generate()`` sizes
  it; sliding-window layers bounded to about twice their window) and the "auto" attention (absorbed, fused SDPA with one latent KV head on the CPU);
- a source model with each stock transformers cache in ``source_caches`` ("dynamic": the default
  DynamicCache; "static": a StaticCache of T + N tokens); the comparison uses the faster one.
The cache is filled by a real prefill of random prompts (timed), or, with ``prefill=False``, by
random cache contents of the same size (only decode is timed: long contexts without minutes of
prefill; decode cost does not depend on the cached values). A short untimed warm-up runs first.

Each row holds the timings, the bytes the cache really held (must equal the formula
``kv_bytes_per_token_per_layer * layers * (T + N) * B`` without sliding-window layers; less with them), the bytes a decode step must read
(weights + cache at context T) and, on CUDA, the peak memory. The MLA row gets the ratios to the
best source row, including the ideal speedup: source bytes per step over MLA bytes per step.
Pure library: no printing beyond optional progress lines on stderr.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from ..dtypes import pick_device, torch_dtype
from ..mla.latent_cache import cache_kwargs
from ..progress import heartbeat
from ..eval.kv import cache_bytes, kv_summary
from ..machine import environment

__all__ = ["bench_generate", "default_dtype", "find_recorded_source", "profile_decode"]

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


def _check_positions(config, spec: str, context: int, new_tokens: int, beyond_positions: bool) -> bool:
    """Does the prompt plus the generated tokens exceed the model's position range? An error unless
    ``beyond_positions`` (speed does not depend on it: RoPE just extrapolates)."""
    limit = getattr(config, "max_position_embeddings", None)
    beyond = bool(limit and context + new_tokens > limit)
    if beyond and not beyond_positions:
        raise ValueError(
            f"context + new_tokens = {context + new_tokens} exceeds max_position_embeddings = {limit} of {spec} "
            "(allow it for a speed measurement with beyond_positions / --beyond-positions)"
        )
    return beyond


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


SOURCE_CACHES = ("dynamic", "static")


def _new_cache(model, kind: str, capacity: int):
    """A fresh cache: "latent" (MLA), "dynamic" or "static" (stock transformers) for ``capacity`` tokens."""
    from transformers import DynamicCache, StaticCache

    from ..mla.model import new_latent_cache

    if kind == "latent":
        return new_latent_cache(model, capacity)
    if kind == "dynamic":
        return DynamicCache(config=model.config)
    if kind == "static":
        return StaticCache(config=model.config, max_cache_len=capacity)
    raise ValueError(f"unknown cache {kind!r}: expected latent, dynamic or static")


def _fill_randomly(model, cache, batch: int, context: int, seed: int) -> None:
    """Put ``context`` tokens of random keys/values in every layer of ``cache`` (shapes as the model caches them)."""
    from ..mla.model import is_mla_config

    gen = torch.Generator().manual_seed(seed)
    param = next(model.parameters())
    config = model.config
    if is_mla_config(config):
        widths, heads = (config.mla["kv_lora_rank"], config.mla["qk_rope_head_dim"]), 1
    else:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        widths, heads = (head_dim, head_dim), config.num_key_value_heads
    for layer in range(config.num_hidden_layers):
        k, v = (torch.randn(batch, heads, context, w, generator=gen).to(param.device, param.dtype) for w in widths)
        cache.update(k, v, layer)  # [B, heads, T, width]


def _fill(model, ids: torch.Tensor, new_tokens: int, cache_kind: str, prefill: bool, seed: int):
    """A fresh cache for the T + ``new_tokens`` tokens, filled with ``ids`` [B, T] by a real prefill or
    with random contents. Returns (cache, the next-token logits [B, 1, vocab], prefill seconds or None)."""
    device = ids.device.type
    B, T = ids.shape
    cache = _new_cache(model, cache_kind, T + new_tokens)
    _sync(device)
    t0 = time.perf_counter()
    if prefill:
        logits = model(input_ids=ids, **cache_kwargs(cache), use_cache=True, logits_to_keep=1).logits  # [B, 1, vocab]
    else:
        _fill_randomly(model, cache, B, T, seed)
        logits = model.lm_head(model.model.embed_tokens(ids[:, -1:]))  # [B, 1, vocab]: any valid next token
    _sync(device)
    return cache, logits, (time.perf_counter() - t0) if prefill else None


def _decode(model, cache, logits: torch.Tensor, steps: int) -> None:
    """``steps`` greedy decode steps through ``cache``, each feeding back the argmax (as generate() does)."""
    for _ in range(steps):
        nxt = logits.argmax(-1)  # [B, 1] greedy
        logits = model(input_ids=nxt, **cache_kwargs(cache), use_cache=True).logits


def _run(model, ids: torch.Tensor, new_tokens: int, cache_kind: str, prefill: bool, seed: int):
    """Fill a fresh cache with ``ids`` [B, T] (a real prefill, or random contents), then decode
    ``new_tokens`` greedy steps. Returns (cache, prefill_seconds or None, decode_seconds)."""
    cache, logits, prefill_s = _fill(model, ids, new_tokens, cache_kind, prefill, seed)
    t1 = time.perf_counter()
    _decode(model, cache, logits, new_tokens)
    _sync(ids.device.type)
    return cache, prefill_s, time.perf_counter() - t1


PROFILE_TOP = 10  # ops listed by profile_decode


def profile_decode(model, ids: torch.Tensor, steps: int, cache_kind: str, seed: int) -> dict[str, Any]:
    """Where ``steps`` decode steps after a random fill of ``ids``' size spend their time, by torch's
    profiler (CPU activities): {"steps", "ms_per_step" (wall while profiling, its overhead included),
    "ops": the PROFILE_TOP ops of largest self time, each {"op", "ms_per_step", "share"} of that wall,
    then "(outside torch ops)": wall minus every op's self time (Python and the model's glue)}. The C
    kernels appear as transmla::cpu_decode_kernel / cpu_prefill_kernel (kernels/backends.py names them)."""
    from torch.profiler import ProfilerActivity, profile

    cache, logits, _ = _fill(model, ids, steps, cache_kind, False, seed)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        _decode(model, cache, logits, steps)
        _sync(ids.device.type)
        wall_ms = 1000 * (time.perf_counter() - t0) / steps
    del cache
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    self_ms = [(e.key, e.self_cpu_time_total / 1000 / steps) for e in events]  # microseconds -> ms per step
    ops = [{"op": name, "ms_per_step": ms, "share": ms / wall_ms} for name, ms in self_ms[:PROFILE_TOP]]
    outside = max(0.0, wall_ms - sum(ms for _, ms in self_ms))
    ops.append({"op": "(outside torch ops)", "ms_per_step": outside, "share": outside / wall_ms})
    return {"steps": steps, "ms_per_step": wall_ms, "ops": ops}


def _random_prompts(vocab_size: int, batch: int, context: int, seed: int, device: str) -> torch.Tensor:
    """Token ids [B, T] drawn uniformly from the vocabulary with a seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, context), generator=gen).to(device)  # [B, T]


def _bench_model(spec: str, batch: int, context: int, new_tokens: int, dtype: str, device: str, seed: int,
                 repeats: int, prefill: bool, source_caches, progress: bool,
                 packed_linears: bool = True, profile_steps: int = 0) -> list[dict[str, Any]]:
    """Load one model, warm it up, time fill + decode ``repeats`` times per cache kind (then profile
    ``profile_steps`` decode steps when asked); one row per cache kind."""
    from ..checkpoint.resolve import load_model
    from ..mla.model import is_mla_config, set_decode_mode
    from ..mla.packed_linear import use_packed_linears

    _status(progress, f"loading {spec} ({dtype}, {device})")
    model, _ = load_model(spec, dtype=torch_dtype(dtype), device=device)
    mla = is_mla_config(model.config)
    old_mode = model.config.mla.get("decode", "auto") if mla else None
    linears = None
    if mla:
        set_decode_mode(model, "auto")
        linears = "onednn-packed" if use_packed_linears(model, packed_linears) and device == "cpu" else "plain"
    rows = []
    try:
        ids = _random_prompts(model.config.vocab_size, batch, context, seed, device)  # [B, T]
        for kind in ("latent",) if mla else source_caches:
            prefills, decodes = [], []
            with torch.inference_mode():
                with heartbeat(f"{spec}: warm-up, {kind} cache", progress):
                    _run(model, ids[:, :WARMUP_PROMPT_TOKENS], 1, kind, True, seed)  # untimed warm-up
                if device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                for rep in range(repeats):
                    # The first repetition's time estimates the others (the warm-up is too short to).
                    expected = (prefills[-1] or 0.0) + decodes[-1] if decodes else None
                    with heartbeat(f"{spec}: {'prefill' if prefill else 'random fill'} {batch}x{context}, decode "
                                   f"{new_tokens} steps, {kind} cache, repetition {rep + 1}/{repeats}", progress, expected):
                        cache, prefill_s, decode_s = _run(model, ids, new_tokens, kind, prefill, seed)
                    prefills.append(prefill_s)
                    decodes.append(decode_s)
                    if rep + 1 < repeats:
                        del cache
                        _free(device)
            peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
            row = _row(spec, model, cache, batch, context, new_tokens, dtype, device, prefills, decodes, peak)
            if profile_steps:
                del cache
                _free(device)
                with heartbeat(f"{spec}: profiling {profile_steps} decode steps, {kind} cache", progress), \
                        torch.inference_mode():
                    row["profile"] = profile_decode(model, ids, profile_steps, kind, seed)
                cache = None
            row.update(cache=kind, decode_mode="auto" if mla else None, linears=linears or "plain (stock)",
                       **(_mla_attention(model, device, prefill) if mla
                          else {"decode_attention": "stock", "prefill_attention": "stock" if prefill else "-"}))
            rows.append(row)
            del cache
            _free(device)
    finally:
        if mla:
            set_decode_mode(model, old_mode)
        del model
        _free(device)
    return rows


def _mla_attention(model, device: str, prefill: bool) -> dict[str, str]:
    """Which attention the MLA model ran: {"decode_attention": ..., "prefill_attention": ...}, each the
    C kernel (mla/kernels/cpu_decode.py, cpu_prefill.py; fp32), the AMX kernel (the same modules; bf16),
    the Triton kernel (CUDA decode), PyTorch's SDPA, or "-" (no prefill: the cache was
    filled randomly)."""
    if device == "cuda":
        return {"decode_attention": "triton", "prefill_attention": "sdpa" if prefill else "-"}
    from ..mla.kernels import cpu_decode, cpu_prefill

    m = model.config.mla
    shape = (model.config.num_attention_heads, m["kv_lora_rank"] + m["qk_rope_head_dim"], m["kv_lora_rank"])
    fp32 = next(model.parameters()).dtype == torch.float32
    dtype, kernel = ("fp32", "c-kernel") if fp32 else ("bf16", "amx-kernel")
    decode = kernel if cpu_decode.KERNEL.status(dtype).get(shape) == "compiled" else "sdpa"
    prefill_ran = kernel if cpu_prefill.KERNEL.status(dtype).get(shape) == "compiled" else "sdpa"
    return {"decode_attention": decode, "prefill_attention": prefill_ran if prefill else "-"}


def _unique_parameter_bytes(model) -> int:
    """Bytes of the weights (tied ones once): what a decode step reads besides the cache."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def _row(spec, model, cache, batch, context, new_tokens, dtype, device, prefills, decodes, peak) -> dict[str, Any]:
    """The result row of one benchmarked model and cache: min and median over the repetitions."""
    kv = kv_summary(model.config, torch_dtype(dtype))
    per_token_layer = kv.kv_bytes_per_token_per_layer
    weights = _unique_parameter_bytes(model)
    cache_at_context = per_token_layer * kv.layers * context * batch
    decode_min, decode_median = min(decodes), statistics.median(decodes)
    timed_prefills = [t for t in prefills if t is not None]
    return {
        "model": spec,
        "attention": kv.attention,
        "batch": batch,
        "context": context,
        "new_tokens": new_tokens,
        "dtype": dtype,
        "device": device,
        "repeats": len(decodes),
        "prefill": bool(timed_prefills),
        "prefill_seconds": min(timed_prefills) if timed_prefills else None,
        "prefill_seconds_median": statistics.median(timed_prefills) if timed_prefills else None,
        "decode_seconds": decode_min,
        "decode_seconds_median": decode_median,
        "decode_seconds_all": decodes,
        "decode_tokens_per_second": batch * new_tokens / decode_min,
        "decode_tokens_per_second_median": batch * new_tokens / decode_median,
        "ms_per_step": 1000 * decode_min / new_tokens,
        "ms_per_step_median": 1000 * decode_median / new_tokens,
        "kv_elements_per_token_per_layer": kv.kv_elements_per_token_per_layer,
        "kv_bytes_per_token_per_layer": per_token_layer,
        "layers": kv.layers,
        "cached_tokens": int(cache.get_seq_length()),
        "cache_bytes": cache_bytes(cache),
        "formula_cache_bytes": per_token_layer * kv.layers * (context + new_tokens) * batch,
        "model_bytes": weights,
        "bytes_per_step": weights + cache_at_context,  # weights + cache at context T, read once per step
        "peak_memory_bytes": peak,
    }


def _status(enabled: bool, text: str) -> None:
    if enabled:
        from ..progress import stderr_console

        stderr_console.print(f"[dim]{text}[/dim]")


def _compare(row: dict[str, Any], source_rows: list[dict[str, Any]]) -> None:
    """Add the ratios to the best source row (fastest decode) to ``row``."""
    best = max(source_rows, key=lambda r: r["decode_tokens_per_second"])
    row["source_cache"] = best["cache"]
    row["speedup_vs_source"] = row["decode_tokens_per_second"] / best["decode_tokens_per_second"]
    row["speedup_vs_source_median"] = row["decode_tokens_per_second_median"] / best["decode_tokens_per_second_median"]
    row["ideal_speedup"] = best["bytes_per_step"] / row["bytes_per_step"]
    row["fraction_of_ideal"] = row["speedup_vs_source"] / row["ideal_speedup"]
    row["cache_ratio_vs_source"] = row["cache_bytes"] / best["cache_bytes"]
    prefills = [r["prefill_seconds"] for r in source_rows if r["prefill_seconds"] is not None]
    if row["prefill_seconds"] is not None and prefills:
        row["prefill_ratio_vs_source"] = row["prefill_seconds"] / min(prefills)
    if row["peak_memory_bytes"] is not None and best["peak_memory_bytes"]:
        row["peak_memory_ratio_vs_source"] = row["peak_memory_bytes"] / best["peak_memory_bytes"]


def bench_generate(
    model: str,
    source: str | None = None,
    batch: int = 1,
    context: int = 512,
    new_tokens: int = 32,
    dtype: str | None = None,
    device: str = "auto",
    seed: int = 0,
    repeats: int = 3,
    prefill: bool = True,
    source_caches=SOURCE_CACHES,
    beyond_positions: bool = False,
    threads: int | None = None,
    progress: bool = False,
    packed_linears: bool = True,
    profile_steps: int = 0,
) -> dict[str, Any]:
    """Decode speed, prefill time and cache of ``model`` and its source: {"environment": ..., "rows": [...]}.

    ``source`` defaults to the one the MLA config records (when it exists on disk); a model that
    is not MLA is benchmarked alone unless a source is given. ``dtype`` defaults to bf16 on CUDA
    and fp32 on the CPU. Rows: ``model`` first (with the ratios to the fastest source row when
    there is a source: ``speedup_vs_source``, ``ideal_speedup``, ``fraction_of_ideal``,
    ``prefill_ratio_vs_source``, ``source_cache``), then the source once per cache in
    ``source_caches``. Models are loaded one at a time; all get the same random prompts (``seed``).
    The environment records the load average before and after. ``threads`` sets torch's CPU
    threads for the run (both models alike; on a shared CPU one thread avoids the stalls of a
    thread team waiting for a descheduled member). ``packed_linears`` False runs the MLA model's
    linears through plain ``F.linear`` (mla/packed_linear.py); each row's ``linears`` says which ran.
    ``profile_steps`` > 0 adds each row's ``profile`` (profile_decode) after its timed runs.
    """
    from ..checkpoint.resolve import load_config

    device = pick_device(device)
    dtype = dtype or default_dtype(device)
    _validate(batch, context, new_tokens, dtype)
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    for kind in source_caches:
        if kind not in SOURCE_CACHES:
            raise ValueError(f"unknown source cache {kind!r}: expected one of {', '.join(SOURCE_CACHES)}")
    if not source_caches:
        raise ValueError("give at least one source cache")
    config = load_config(model)
    source = _resolve_source(model, config, source)
    beyond = _check_positions(config, model, context, new_tokens, beyond_positions)
    if source is not None:
        beyond |= _check_positions(load_config(source), source, context, new_tokens, beyond_positions)

    if threads is not None and threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    if profile_steps < 0:
        raise ValueError(f"profile_steps must be at least 0, got {profile_steps}")
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads or old_threads)
    try:
        env = environment()
        specs = [model] if source is None else [model, source]
        rows = [row for spec in specs for row in _bench_model(
            spec, batch, context, new_tokens, dtype, device, seed, repeats, prefill, tuple(source_caches), progress,
            packed_linears, profile_steps)]
    finally:
        torch.set_num_threads(old_threads)
    env["load_average_after"] = round(os.getloadavg()[0], 2)
    env["beyond_trained_positions"] = beyond
    if source is not None:
        _compare(rows[0], rows[1:])
    return {"environment": env, "rows": rows}
