"""`transmla bench ...`: speed benchmarks. Parses options, calls the library, prints."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from .common import JsonFlag, stdout

bench_app = typer.Typer(
    help="Speed benchmarks. generate: end-to-end decode tokens/s and peak memory of a converted model "
    "against its source (CPU or GPU). decode: one layer's absorbed-MLA decode step (Triton kernel) against "
    "the GQA source cache (torch SDPA) and the unfused PyTorch path (CUDA GPU only).",
    no_args_is_help=True,
)


def _fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    raise typer.Exit(1)


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


@bench_app.command("decode")
def decode(
    batch: Annotated[int, typer.Option(help="Sequences per decode step (B).")] = 64,
    context: Annotated[int, typer.Option(help="Cached tokens per sequence (T).")] = 8192,
    heads: Annotated[int, typer.Option(help="Query heads (H).")] = 32,
    kv_lora_rank: Annotated[int, typer.Option(help="MLA latent width d_c.")] = 512,
    rope_dim: Annotated[int, typer.Option(help="MLA shared rope-key width d_r.")] = 64,
    gqa_kv_heads: Annotated[int, typer.Option(help="GQA source: KV heads.")] = 8,
    gqa_head_dim: Annotated[int, typer.Option(help="GQA source: head dim.")] = 128,
    t_q: Annotated[int, typer.Option("--t-q", help="New query tokens per sequence (1..4).")] = 1,
    dtype: Annotated[str, typer.Option(help="bf16, fp16 or fp32.")] = "bf16",
    tune: Annotated[bool, typer.Option(help="Also search the kernel's launch parameters.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Time one decode step of one layer: MLA Triton kernel vs PyTorch reference vs GQA SDPA."""
    from transmla.bench.decode import (
        BenchUnavailable,
        DecodeShape,
        bench_decode,
        tune_mla_triton,
    )

    try:
        shape = DecodeShape(batch=batch, context=context, heads=heads, kv_lora_rank=kv_lora_rank,
                            rope_dim=rope_dim, gqa_kv_heads=gqa_kv_heads, gqa_head_dim=gqa_head_dim,
                            t_q=t_q, dtype=dtype)
    except ValueError as exc:
        _fail(str(exc))
    try:
        rows = bench_decode(shape)
        tuned = None
        if tune:
            best, _ = tune_mla_triton(shape, copy_gbps=rows[0]["copy_gbps"])
            tuned = bench_decode(shape, impls=("mla_triton",), copy_gbps=rows[0]["copy_gbps"],
                                 triton_kwargs=best)[0]
            tuned["impl"] = "mla_triton_tuned"
            rows.append(tuned)
    except BenchUnavailable as exc:
        _fail(str(exc))

    if as_json:
        print(json.dumps(rows, indent=2, default=str))
        return
    r0 = rows[0]
    table = Table(title=(f"decode step: B={shape.batch} T={shape.context} H={shape.heads} T_q={shape.t_q} "
                         f"MLA {shape.kv_lora_rank}+{shape.rope_dim} vs GQA {shape.gqa_kv_heads}x"
                         f"{shape.gqa_head_dim} {shape.dtype} on {r0['gpu']} "
                         f"(copy {r0['copy_gbps']:.0f} GB/s)"))
    for col in ("impl", "cache elems/token", "MB read", "ms", "GB/s", "TFLOP/s", "of copy BW",
                "x kernel time"):
        table.add_column(col, justify="left" if col == "impl" else "right")
    for r in rows:
        table.add_row(r["impl"], str(r["cache_elems_per_token"]), f"{r['bytes'] / 1e6:.1f}",
                      f"{r['ms']:.4f}", f"{r['gbps']:.0f}", f"{r['tflops']:.1f}",
                      _fmt(r["bandwidth_fraction"], ".1%"), _fmt(r.get("x_vs_mla_triton"), ".2f"))
    stdout.print(table)
    cfg = next((r.get("config") for r in rows if r["impl"] == "mla_triton"), None)
    if cfg:
        stdout.print(f"kernel config: {cfg}" + (f"; tuned: {tuned['config']}" if tuned else ""))


@bench_app.command("generate")
def generate(
    model: Annotated[str, typer.Argument(help="Model to benchmark: a folder, .gguf file, built-in name or hub id.")],
    source: Annotated[str | None, typer.Option(
        help="Model to compare with; default: the source an MLA model records, when it exists here.")] = None,
    batch: Annotated[int, typer.Option(help="Sequences decoded together (B).")] = 1,
    context: Annotated[int, typer.Option(help="Prompt tokens per sequence (T), random ids.")] = 512,
    new_tokens: Annotated[int, typer.Option(help="Tokens decoded per sequence (N), one step each.")] = 32,
    dtype: Annotated[str | None, typer.Option(help="fp32, bf16 or fp16 (default: bf16 on CUDA, fp32 on CPU).")] = None,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    seed: Annotated[int, typer.Option(help="Seed of the random prompts.")] = 0,
    repeats: Annotated[int, typer.Option(help="Repetitions per model and cache (min and median reported).")] = 3,
    prefill: Annotated[bool, typer.Option(
        help="Fill the cache by a timed prefill; --no-prefill fills it with random values (decode timing only).")] = True,
    source_cache: Annotated[list[str] | None, typer.Option(
        help="Stock transformers cache(s) the source runs with: dynamic, static (repeatable; default both, "
             "the faster is compared).")] = None,
    beyond_positions: Annotated[bool, typer.Option(
        help="Allow context + new tokens beyond max_position_embeddings (a speed measurement only).")] = False,
    threads: Annotated[int | None, typer.Option(
        help="torch CPU threads for both models (default: torch's; 1 is steadier on a shared CPU).")] = None,
    packed_linears: Annotated[bool, typer.Option(
        help="The MLA model's linears use oneDNN-prepacked weights on the CPU (bf16, or fp32 at 4 to 16 rows); "
             "--no-packed-linears runs plain F.linear, as the stock source does.")] = True,
    profile_steps: Annotated[int, typer.Option(
        help="After the timed runs, profile this many decode steps per model and cache with torch's profiler "
             "and list the ops of largest self time (0: no profile).")] = 0,
    as_json: JsonFlag = False,
) -> None:
    """End-to-end greedy decode: tokens/s, prefill, cache bytes, MLA model against its source's best stock cache."""
    from transmla.bench.generate import SOURCE_CACHES, bench_generate

    try:
        result = bench_generate(model, source, batch=batch, context=context, new_tokens=new_tokens,
                                dtype=dtype, device=device, seed=seed, repeats=repeats, prefill=prefill,
                                source_caches=tuple(source_cache or SOURCE_CACHES),
                                beyond_positions=beyond_positions, threads=threads,
                                progress=True, packed_linears=packed_linears, profile_steps=profile_steps)
    except ValueError as exc:
        _fail(str(exc).strip().splitlines()[0])
    if as_json:
        print(json.dumps(result, indent=2, default=str))
        return
    stdout.print(_generate_table(result))
    for row in result["rows"]:
        if "profile" in row:
            stdout.print(_profile_table(row))


def _profile_table(row: dict) -> Table:
    """The ops of largest self time in one model's profiled decode steps."""
    prof = row["profile"]
    table = Table(title=f"{Path(row['model']).name or row['model']} ({row['cache']} cache): {prof['steps']} decode "
                        f"steps profiled, {prof['ms_per_step']:.1f} ms a step with the profiler on")
    table.add_column("op (self time)")
    table.add_column("ms/step", justify="right")
    table.add_column("share", justify="right")
    for op in prof["ops"]:
        table.add_row(op["op"], f"{op['ms_per_step']:.2f}", f"{op['share']:.0%}")
    return table


def _generate_table(result: dict) -> Table:
    """One column per model and cache, one line per measure: timings (min / median), cache, bytes per step."""
    rows, env = result["rows"], result["environment"]
    r0 = rows[0]
    table = Table(title=f"generate: B={r0['batch']} T={r0['context']} N={r0['new_tokens']} {r0['dtype']} on "
                        f"{r0['device']}, {env['threads']} threads, {r0['repeats']} repeats, load {env['load_average']} -> "
                        f"{env['load_average_after']}")
    table.add_column("")
    for r in rows:
        table.add_column(f"{Path(r['model']).name or r['model']} ({r['cache']})", justify="right")
    mb = lambda v: None if v is None else v / 1e6
    lines = (
        ("attention", lambda r: r["attention"]),
        ("linears", lambda r: r.get("linears", "-")),
        ("decode attention", lambda r: r.get("decode_attention", "-")),
        ("prefill attention", lambda r: r.get("prefill_attention", "-")),
        ("prefill s (min / median)", lambda r: "-" if r["prefill_seconds"] is None
         else f"{r['prefill_seconds']:.3f} / {r['prefill_seconds_median']:.3f}"),
        ("decode ms/step (min / median)", lambda r: f"{r['ms_per_step']:.2f} / {r['ms_per_step_median']:.2f}"),
        ("decode tokens/s (best)", lambda r: f"{r['decode_tokens_per_second']:.1f}"),
        ("x source tokens/s", lambda r: _fmt(r.get("speedup_vs_source"), ".2f")),
        ("ideal x (bytes/step)", lambda r: _fmt(r.get("ideal_speedup"), ".2f")),
        ("x source prefill time", lambda r: _fmt(r.get("prefill_ratio_vs_source"), ".2f")),
        ("bytes/step MB", lambda r: f"{mb(r['bytes_per_step']):.1f}"),
        ("cache MB", lambda r: f"{mb(r['cache_bytes']):.3f}"),
        ("cache MB (formula)", lambda r: f"{mb(r['formula_cache_bytes']):.3f}"),
        ("x source cache", lambda r: _fmt(r.get("cache_ratio_vs_source"), ".3f")),
        ("peak memory MB", lambda r: _fmt(mb(r["peak_memory_bytes"]), ".1f")),
    )
    for name, cell in lines:
        table.add_row(name, *(cell(r) for r in rows))
    return table
