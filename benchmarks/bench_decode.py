"""Absorbed-MLA decode speed on a CUDA GPU: how close the Triton kernel gets to the memory bandwidth.

    python -m benchmarks.bench_decode --out benchmarks/results           # full sweep + tuning (GPU, a few minutes)
    python -m benchmarks.bench_decode --out /tmp/decode --quick    # smoke run (GPU, ~1 minute)
    python -m benchmarks.bench_decode --out /tmp/decode --dry-run  # CPU plumbing check, meaningless numbers

Sweep: T in {1K, 2K, 4K, 8K, 16K, 32K} x H in {8, 16, 32, 64, 128} at B = 64 (halved while the
benchmark's estimated peak memory exceeds --mem-limit-gb), MLA 512+64 bf16, T_q = 1. Each point
times the Triton kernel, the unfused PyTorch reference and the GQA source cache (8 KV heads x
128) read by torch SDPA. Then: the goal shape (B=64, T=8192, H=32) with a small launch-parameter
search (goal: >= 70% of the measured device copy bandwidth), and the Llama-3-8B-like comparison
at 32K (32 query heads; 8x128 GQA cache, 2048 elements/token, vs MLA 512+64, 576).

Writes <out>/decode_bench.json (all rows: bandwidth_fraction, GPU name, torch/triton versions),
<out>/decode_bench.md and <out>/decode_bench.png (bandwidth fraction vs T, one line per H).
Bytes counted: cache B*T*(d_c+d_r)*2 + queries + outputs; bandwidth_fraction = (bytes / time) /
(measured device-to-device copy bandwidth, read + write bytes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path

from .common import log

GOAL_FRACTION = 0.70
GOAL = dict(batch=64, context=8192, heads=32)
LLAMA3_8B = dict(context=32768, heads=32, gqa_kv_heads=8, gqa_head_dim=128)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--quick", action="store_true", help="smoke run: T in {1K, 8K}, H = 32, no tuning")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU plumbing check with tiny shapes (Triton interpreter); numbers are meaningless")
    ap.add_argument("--no-tune", action="store_true", help="skip the launch-parameter search")
    ap.add_argument("--kernel-only", action="store_true", help="sweep only the Triton kernel (no baselines)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--mem-limit-gb", type=float, default=60.0)
    ap.add_argument("--rep", type=int, default=100, help="do_bench timed milliseconds per measurement")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    import torch

    from transmla.bench import decode as db
    from transmla.machine import gpu_environment

    if not args.dry_run and not torch.cuda.is_available():
        print("error: benchmarks.bench_decode needs a CUDA GPU (use --dry-run for a CPU plumbing check)",
              file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    dry = args.dry_run

    # ------------------------------------------------------------------ grid
    if dry:
        base = db.DecodeShape(batch=2, context=64, heads=4, kv_lora_rank=32, rope_dim=16,
                              gqa_kv_heads=2, gqa_head_dim=16, dtype="fp32")
        Ts, Hs = (64, 128), (4, 8)
        goal = dict(batch=2, context=128, heads=8)
        llama = dict(context=128, heads=8, gqa_kv_heads=2, gqa_head_dim=16)
    else:
        base = db.DecodeShape(batch=args.batch, kv_lora_rank=512, rope_dim=64, gqa_kv_heads=8,
                              gqa_head_dim=128, dtype=args.dtype)
        Ts = (1024, 8192) if args.quick else (1024, 2048, 4096, 8192, 16384, 32768)
        Hs = (32,) if args.quick else (8, 16, 32, 64, 128)
        goal, llama = dict(GOAL, batch=args.batch), dict(LLAMA3_8B)
    impls = ("mla_triton",) if args.kernel_only else db.IMPLS
    warmup, rep = (1, 1) if dry else (25, args.rep)
    limit = args.mem_limit_gb * 1e9

    device = db.require_cuda(dry)
    env = gpu_environment(device)
    log(f"device: {env['gpu']} | torch {env['torch_version']} | triton {env['triton_version']}")
    copy_gbps = db.measure_copy_bandwidth(device)
    log(f"measured device copy bandwidth: {copy_gbps:.0f} GB/s (read + write)")

    rows: list[dict] = []
    meta = dict(env, copy_gbps=copy_gbps, dtype=base.dtype, date=time.strftime("%Y-%m-%d %H:%M:%S"),
                args=" ".join(sys.argv[1:]), dry_run=dry, batch=base.batch,
                mla=f"{base.kv_lora_rank}+{base.rope_dim}", goal_fraction=GOAL_FRACTION,
                bytes_formula="B*T*(d_c+d_r)*elem + B*T_q*H*(d_c+d_r)*elem + B*T_q*H*d_c*elem",
                bandwidth_fraction="achieved GB/s / measured device-to-device copy GB/s (read+write)")

    def write():
        (args.out / "decode_bench.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1, default=str))

    def run(section: str, shape, which=impls, **kw) -> list[dict]:
        fitted = db.fit_batch(shape, limit, which)
        if fitted.batch != shape.batch:
            log(f"  batch {shape.batch} -> {fitted.batch} (memory limit {args.mem_limit_gb:.0f} GB)")
        try:
            out = db.bench_decode(fitted, impls=which, copy_gbps=copy_gbps, warmup=warmup, rep=rep,
                                  dry_run=dry, **kw)
        except Exception as exc:  # keep sweeping; record the failure
            log(f"  FAILED {section} {fitted}: {type(exc).__name__}: {exc}")
            traceback.print_exc()
            out = [dict(impl=i, error=f"{type(exc).__name__}: {exc}", **dataclasses.asdict(fitted))
                   for i in which]
        for r in out:
            r["section"] = section
        rows.extend(out)
        write()
        return out

    # ------------------------------------------------------------------ sweep
    for T in Ts:
        for H in Hs:
            shape = dataclasses.replace(base, context=T, heads=H)
            out = run("sweep", shape)
            k = next((r for r in out if r["impl"] == "mla_triton" and "ms" in r), None)
            if k:
                log(f"T={T:6d} H={H:4d} B={k['batch']:3d}: {k['ms']:.4f} ms {k['gbps']:7.0f} GB/s "
                    f"= {k['bandwidth_fraction']:.1%} of copy | "
                    + " ".join(f"{r['impl']} x{r['x_vs_mla_triton']:.2f}" for r in out
                               if r["impl"] != "mla_triton" and "ms" in r))

    # ------------------------------------------------------------------ goal shape (+ tuning)
    goal_shape = dataclasses.replace(base, **goal)
    goal_rows = run("goal_default", goal_shape, which=("mla_triton",))
    tuned_row = None
    if not (args.no_tune or args.quick):
        log("tuning the goal shape ...")
        try:
            best, tune_rows = db.tune_mla_triton(goal_shape, copy_gbps=copy_gbps, dry_run=dry,
                                                 max_configs=6 if dry else None,
                                                 warmup=warmup, rep=max(rep // 2, 1))
            for r in tune_rows:
                r["section"] = "tune"
            rows.extend(tune_rows)
            tuned_row = run("goal_tuned", goal_shape, which=("mla_triton",), triton_kwargs=best)[0]
            log(f"tuned config {best}: {tuned_row.get('bandwidth_fraction', float('nan')):.1%} of copy")
        except Exception as exc:
            log(f"  tuning FAILED: {type(exc).__name__}: {exc}")
            traceback.print_exc()

    # ------------------------------------------------------------------ Llama-3-8B-like at 32K
    run("llama3_8b_32k", dataclasses.replace(base, batch=goal["batch"], **llama), which=db.IMPLS)

    best_goal = max((r for r in goal_rows + ([tuned_row] if tuned_row else []) if r and "ms" in r),
                    key=lambda r: r["bandwidth_fraction"], default=None)
    meta["goal"] = dict(
        shape=goal, target_fraction=GOAL_FRACTION,
        default_fraction=goal_rows[0].get("bandwidth_fraction"),
        tuned_fraction=tuned_row.get("bandwidth_fraction") if tuned_row else None,
        tuned_config=tuned_row.get("config") if tuned_row else None,
        met=bool(best_goal and best_goal["bandwidth_fraction"] >= GOAL_FRACTION),
    )
    write()
    (args.out / "decode_bench.md").write_text(render_markdown(meta, rows, Ts, Hs))
    try:
        plot(rows, Ts, Hs, args.out / "decode_bench.png", meta)
    except Exception as exc:  # the numbers matter more than the picture
        log(f"plot failed: {type(exc).__name__}: {exc}")
    log(f"wrote {args.out}/decode_bench.json, .md, .png")
    g = meta["goal"]
    log(f"goal B={goal['batch']} T={goal['context']} H={goal['heads']}: default "
        f"{_pct(g['default_fraction'])}, tuned {_pct(g['tuned_fraction'])} (target {GOAL_FRACTION:.0%})")
    return 0


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def _find(rows, section, impl, T=None, H=None):
    for r in rows:
        if r.get("section") == section and r.get("impl") == impl and "ms" in r \
                and (T is None or r["context"] == T) and (H is None or r["heads"] == H):
            return r
    return None


def render_markdown(meta: dict, rows: list[dict], Ts, Hs) -> str:
    L = [
        "# Absorbed MLA decode: Triton kernel vs memory bandwidth",
        "",
        f"GPU: **{meta['gpu']}** | torch {meta['torch_version']} | triton {meta['triton_version']} | "
        f"CUDA {meta.get('cuda_version')} | {meta['date']}" + (" | **DRY RUN (CPU, meaningless)**"
                                                             if meta.get("dry_run") else ""),
        "",
        f"Measured device-to-device copy bandwidth: **{meta['copy_gbps']:.0f} GB/s** (read + write bytes).",
        f"Bytes per step: {meta['bytes_formula']}. bandwidth fraction = {meta['bandwidth_fraction']}.",
        "",
    ]
    g = meta.get("goal")
    if g:
        L += [
            f"## Goal: B={g['shape']['batch']}, T={g['shape']['context']}, H={g['shape']['heads']}, "
            f"MLA {meta['mla']}, {meta['dtype']}: >= {g['target_fraction']:.0%} of copy bandwidth",
            "",
            f"- default launch config: {_pct(g['default_fraction'])}",
            f"- tuned: {_pct(g['tuned_fraction'])}" + (f" with `{g['tuned_config']}`" if g['tuned_config'] else ""),
            f"- met: **{'yes' if g['met'] else 'no'}**",
            "",
        ]
    L += ["## Sweep: Triton kernel, fraction of copy bandwidth (B in parentheses when scaled down)", ""]
    L.append("| T \\ H | " + " | ".join(str(h) for h in Hs) + " |")
    L.append("|---|" + "---|" * len(Hs))
    for T in Ts:
        cells = []
        for H in Hs:
            r = _find(rows, "sweep", "mla_triton", T, H)
            if r is None:
                cells.append("failed")
                continue
            c = f"{r['bandwidth_fraction']:.1%}"
            if r["batch"] != meta["batch"]:
                c += f" (B={r['batch']})"
            cells.append(c)
        L.append(f"| {T} | " + " | ".join(cells) + " |")
    L += ["", "## Sweep: time per decode step (ms): kernel / PyTorch reference / GQA SDPA", ""]
    L.append("| T \\ H | " + " | ".join(str(h) for h in Hs) + " |")
    L.append("|---|" + "---|" * len(Hs))
    for T in Ts:
        cells = []
        for H in Hs:
            parts = []
            for impl in ("mla_triton", "mla_torch_reference", "gqa_sdpa"):
                r = _find(rows, "sweep", impl, T, H)
                parts.append("-" if r is None else f"{r['ms']:.3f}")
            cells.append(" / ".join(parts))
        L.append(f"| {T} | " + " | ".join(cells) + " |")
    cmp_rows = [r for r in rows if r.get("section") == "llama3_8b_32k" and "ms" in r]
    if cmp_rows:
        r0 = cmp_rows[0]
        L += ["", f"## Llama-3-8B-like decode step at T={r0['context']}, B={r0['batch']}, H={r0['heads']}", "",
              "| implementation | cache elems/token/layer | MB read | ms | GB/s | fraction of copy BW | time / kernel time |",
              "|---|---|---|---|---|---|---|"]
        for r in cmp_rows:
            L.append(f"| {r['impl']} | {r['cache_elems_per_token']} | {r['bytes'] / 1e6:.1f} | {r['ms']:.4f} | "
                     f"{r['gbps']:.0f} | {r['bandwidth_fraction']:.1%} | {r.get('x_vs_mla_triton', float('nan')):.2f} |")
    L += ["", "Produced by `python -m benchmarks.bench_decode` (see its docstring); raw rows in decode_bench.json.", ""]
    return "\n".join(L)


def plot(rows: list[dict], Ts, Hs, path: Path, meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for H in Hs:
        pts = [(T, r["bandwidth_fraction"]) for T in Ts
               if (r := _find(rows, "sweep", "mla_triton", T, H)) is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"H={H}")
    ax.axhline(GOAL_FRACTION, color="gray", linestyle="--", linewidth=1, label=f"goal {GOAL_FRACTION:.0%}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(Ts))
    ax.set_xticklabels([f"{T // 1024}K" if T >= 1024 else str(T) for T in Ts])
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("context T (tokens)")
    ax.set_ylabel("fraction of measured copy bandwidth")
    ax.set_title(f"MLA decode (Triton), {meta['dtype']}, {meta['gpu']}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
