"""Decode tokens/s of the converted built-in model against its source on this CPU, and the ideal.

    .venv/bin/python -m benchmarks.generate_bench              # every setting not yet in the JSON, then the report
    .venv/bin/python -m benchmarks.generate_bench --only 25-fp32-b1-8k,25-fp32-b8-8k   # some settings
    .venv/bin/python -m benchmarks.generate_bench --report     # only rewrite the table and plot

Each setting is one `transmla bench generate` run (the library call behind it): the TransMLA
conversion of smollm2-135m at 25% (or 12.5%) of the source cache, converted once with the CLI
defaults in the native shape (`transmla convert smollm2-135m OUT --method transmla --kv-budget B
--per-layer-rope`, kept under
$TRANSMLA_CACHE/bench-generate), against the source with both stock transformers caches
(dynamic and static; the faster one is compared), greedy decode of NEW_TOKENS tokens after the
context, REPEATS repetitions (min reported, median kept in the JSON). The 2K and 4K settings fill
the cache by a real, timed prefill (the prefill ratio); the others fill it with random values of the
same size (--no-prefill: decode cost does not depend on the cached values, and a 32K prefill takes
minutes on this CPU). Beyond 8K tokens the positions pass SmolLM2's max_position_embeddings
(speed only).

Ideal speedup = bytes a decode step reads, source over MLA: weights (tied embeddings once) plus the
KV cache at that context, both in the same dtype. Goal: MLA tokens/s over the source's >= 0.8 x ideal
at every context >= 8K; prefill within 1.2x of the source's.

Settings ending in `-plain` run the MLA model's linears through plain F.linear (`--no-packed-linears`):
every row measured before mla/packed_linear.py existed was such a row, and their decode attention
was PyTorch's fused SDPA. The others use its oneDNN-prepacked weights (the default of `transmla
bench generate` and of generate()) and, in fp32, the C decode kernel (mla/kernels/cpu_decode.py;
column `MLA attention`, from each row's `decode_attention`) and, since the session of 2026-11-25 09:20,
the C prefill kernel (cpu_prefill.py, `prefill_attention`); bf16 prompts since 14:35 that day the AMX
kernel (cpu_prefill_amx.c), and bf16 decode since 19:58 the AMX decode kernel (cpu_decode_amx.c; the rows
measured before it are kept under `history_sdpa_decode` and listed below the table); the source always
runs stock. The prefill settings measured before these
kernels (in PyTorch's fused SDPA) are kept in the JSON under `history_sdpa_prefill` and listed below
the table.

Writes benchmarks/results/generate_bench.json, generate_bench.md and generate_bench.png (or STEM.* with
--stem STEM: another machine's rows); the JSON is saved after every setting (resumable). --unfitted
converts with --fit-steps 0 (the same shapes, so the same speed, without the fit's minutes). Run one benchmark process at a time; the load average is
recorded with each setting.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import transmla  # noqa: F401
from transmla.checkpoint.resolve import cache_root
from transmla.bench.generate import bench_generate

from .common import RESULTS, load_json, machine, save_json

STEM = "generate_bench"  # results file stem; --stem names another (another machine's rows)
MODELS = cache_root() / "bench-generate"
SOURCE = "smollm2-135m"
NEW_TOKENS = 16
REPEATS = 3
THREADS = 1  # the CPU is shared: one thread per model, the same for both (see bench_generate)
BUDGETS = {"25": 0.25, "12.5": 0.125}


def _setting(budget: str, dtype: str, batch: int, context: int, prefill: bool, linears: str = "packed",
             suffix: str = "") -> dict:
    name = f"{budget}-{dtype}-b{batch}-{round(context / 1024)}k{suffix}" + ("-plain" if linears == "plain" else "")
    return dict(name=name, budget=budget, dtype=dtype, batch=batch, context=context, prefill=prefill, linears=linears)


PACKED_SETTINGS = [
    _setting("25", "fp32", 1, 2048, True),
    _setting("25", "fp32", 1, 4096, True),
    _setting("25", "fp32", 1, 8192, False),
    _setting("25", "fp32", 1, 16384, False),
    _setting("25", "fp32", 1, 32768, False),
    _setting("25", "fp32", 8, 2048, True),
    _setting("25", "fp32", 8, 8192, False),
    _setting("25", "fp32", 8, 16384, False),
    _setting("25", "fp32", 8, 32768, False),
    _setting("25", "bf16", 1, 8192, False),
    _setting("25", "bf16", 1, 16384, False),
    _setting("25", "bf16", 1, 32768, False),
    _setting("25", "bf16", 8, 8192, False),
    _setting("25", "bf16", 8, 16384, False),
    _setting("12.5", "fp32", 1, 8192, False),
    _setting("12.5", "fp32", 1, 32768, False),
    _setting("12.5", "fp32", 8, 8192, False),
    _setting("12.5", "bf16", 1, 32768, False),
    _setting("12.5", "bf16", 8, 8192, False),
    _setting("25", "fp32", 1, 8192, True, suffix="-prefill"),  # a real 8K prefill: its time grows as T^2
    _setting("25", "bf16", 1, 2048, True),  # bf16 prompts: the AMX kernel (cpu_prefill_amx.c) since 14:35
    _setting("12.5", "fp32", 1, 2048, True),
    _setting("25", "fp32", 1, 16384, True, suffix="-prefill"),
    _setting("25", "bf16", 1, 8192, True, suffix="-prefill"),  # bf16 prompts at length
    _setting("25", "bf16", 1, 16384, True, suffix="-prefill"),
    _setting("25", "bf16", 1, 32768, True, suffix="-prefill"),
    _setting("25", "fp32", 1, 32768, True, suffix="-prefill"),
    # the remaining grid of the goal (25% and 12.5%, fp32 and bf16, batch 1 and 8, 8K-32K)
    _setting("25", "bf16", 8, 32768, False),
    _setting("12.5", "fp32", 1, 16384, False),
    _setting("12.5", "fp32", 8, 16384, False),
    _setting("12.5", "fp32", 8, 32768, False),
    _setting("12.5", "bf16", 1, 8192, False),
    _setting("12.5", "bf16", 1, 16384, False),
    _setting("12.5", "bf16", 8, 16384, False),
    _setting("12.5", "bf16", 8, 32768, False),
    _setting("12.5", "fp32", 1, 8192, True, suffix="-prefill"),
    _setting("12.5", "bf16", 1, 8192, True, suffix="-prefill"),
]
# The same settings with the MLA model's linears through plain F.linear (`--no-packed-linears`), as
# every row was measured before the packed linears (mla/packed_linear.py) existed.
PLAIN = ("25-fp32-b1-2k", "25-fp32-b1-4k", "25-fp32-b1-8k", "25-fp32-b1-16k", "25-fp32-b1-32k", "25-fp32-b8-2k",
         "25-fp32-b8-8k", "25-bf16-b1-8k", "25-bf16-b1-32k", "25-bf16-b8-8k", "12.5-fp32-b1-8k", "12.5-fp32-b1-32k")
SETTINGS = PACKED_SETTINGS + [_setting(s["budget"], s["dtype"], s["batch"], s["context"], s["prefill"], "plain")
                              for s in PACKED_SETTINGS if s["name"] in PLAIN]


def converted_model(budget: str, fitted: bool = True) -> Path:
    """The CLI-default TransMLA conversion at this budget in the native shape (--per-layer-rope),
    converted once, then reused; with ``fitted`` False, the same with --fit-steps 0: the same shapes, so the same speed, in a few
    minutes instead of the default fit's (about 25 minutes on a CPU without bf16 matrix units)."""
    out = MODELS / (f"transmla-{budget}" + ("" if fitted else "-fit0"))
    if not (out / "config.json").exists():
        cli = Path(sys.executable).with_name("transmla")
        subprocess.run([str(cli), "convert", SOURCE, str(out), "--method", "transmla",
                        "--kv-budget", str(BUDGETS[budget]), "--per-layer-rope",
                        *([] if fitted else ["--fit-steps", "0"])], check=True)
    return out


def run_setting(setting: dict, fitted: bool = True) -> dict:
    result = bench_generate(
        str(converted_model(setting["budget"], fitted)), SOURCE, batch=setting["batch"], context=setting["context"],
        new_tokens=NEW_TOKENS, dtype=setting["dtype"], device="cpu", repeats=REPEATS, prefill=setting["prefill"],
        beyond_positions=True, threads=THREADS, progress=True, packed_linears=setting["linears"] == "packed",
    )
    return {**setting, "fitted": fitted, **result}


def _keep_sdpa_decode(results: dict, name: str) -> None:
    """A packed bf16 row measured with PyTorch's SDPA as decode attention (before cpu_decode_amx.c) moves to
    `history_sdpa_decode` when its setting is run again (the first such row is kept)."""
    old = results["settings"].get(name)
    if (old and old["dtype"] == "bf16" and old.get("linears") == "packed"
            and old["rows"][0].get("decode_attention", "sdpa") == "sdpa"):  # rows before the field: SDPA
        results.setdefault("history_sdpa_decode", {}).setdefault(name, old)


def _ratio(v, spec=".2f") -> str:
    return "-" if v is None else format(v, spec)


def write_report(results: dict, stem: str = STEM) -> None:
    rows = [results["settings"][s["name"]] for s in SETTINGS if s["name"] in results["settings"]]
    unfitted = [r["name"] for r in rows if not r.get("fitted", True)]
    lines = [
        "# Decode speed on the CPU: converted SmolLM2-135M (TransMLA) against its source",
        "",
        "Made by `python -m benchmarks.generate_bench` (see its docstring). Greedy decode of "
        f"{NEW_TOKENS} tokens after the context, {REPEATS} repetitions, best (min time) reported; the source "
        "runs with the faster of transformers' DynamicCache and StaticCache (column `source cache`). "
        "Ideal = bytes read per decode step (weights + cache at the context), source over MLA. "
        "`fill`: prefill = a real prefill (timed: the prefill ratio), random = cache filled with random "
        "values of the same size (decode timing only). Load = 1-minute load average before -> after "
        "(2 cores; anything above ~2 means other jobs shared the CPU).",
        "",
        f"Machine: {results.get('machine', '?')}.",
        "",
        *([f"Converted with --fit-steps 0 (the default shapes, so the default's speed): {', '.join(unfitted)}.", ""]
          if unfitted else []),
        "| setting | MLA linears | MLA attention (decode, prefill) | fill | MLA tok/s | source tok/s | source cache | speedup | ideal | speedup / ideal | "
        "prefill MLA s | prefill source s | prefill ratio | MLA cache MB | source cache MB | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mla = r["rows"][0]
        src = next(x for x in r["rows"][1:] if x["cache"] == mla["source_cache"])
        env = r["environment"]
        lines.append(
            f"| {r['name']} | {r.get('linears', 'plain')} | {mla.get('decode_attention', 'sdpa')}, "
            f"{mla.get('prefill_attention', 'sdpa' if r['prefill'] else '-')} | {'prefill' if r['prefill'] else 'random'} | {mla['decode_tokens_per_second']:.2f} "
            f"| {src['decode_tokens_per_second']:.2f} | {src['cache']} | {mla['speedup_vs_source']:.2f} "
            f"| {mla['ideal_speedup']:.2f} | {mla['fraction_of_ideal']:.2f} | {_ratio(mla['prefill_seconds'], '.1f')} "
            f"| {_ratio(min((x['prefill_seconds'] for x in r['rows'][1:] if x['prefill_seconds']), default=None), '.1f')} "
            f"| {_ratio(mla.get('prefill_ratio_vs_source'))} | {mla['cache_bytes'] / 1e6:.1f} "
            f"| {src['cache_bytes'] / 1e6:.1f} | {env['load_average']} -> {env['load_average_after']} |"
        )
    load = lambda env: f"{env['load_average']} -> {env['load_average_after']}"
    best_prefill = lambda r: min(x["prefill_seconds"] for x in r["rows"][1:] if x["prefill_seconds"])
    same_cache = lambda r: next(x for x in r["rows"][1:] if x["cache"] == r["rows"][0]["source_cache"])
    lines += _side_table(
        "Prefill before the prefill kernels (MLA prefill attention in PyTorch's fused SDPA, value 96 wide; fp32 "
        "before cpu_prefill.c, bf16 before cpu_prefill_amx.c), the same settings measured earlier:",
        ["setting", "prefill MLA s", "prefill source s", "prefill ratio", "load"], results.get("history_sdpa_prefill", {}),
        lambda r: [f"{r['rows'][0]['prefill_seconds']:.1f}", f"{best_prefill(r):.1f}",
                   f"{r['rows'][0]['prefill_ratio_vs_source']:.2f}", load(r["environment"])])
    lines += _side_table(
        "Single runs alone on the CPU (`transmla bench generate ... --repeats 1 --threads 1`, nothing else running; "
        "the command is in each run's JSON entry), to check a ratio measured under load:",
        ["run", "prefill MLA s", "prefill source s", "prefill ratio", "MLA tok/s", "source tok/s", "load"],
        results.get("runs_alone", {}),
        lambda r: [_ratio(r["rows"][0]["prefill_seconds"], ".1f"), _ratio(r["rows"][1]["prefill_seconds"], ".1f"),
                   _ratio(r["rows"][0].get("prefill_ratio_vs_source")), f"{r['rows'][0]['decode_tokens_per_second']:.2f}",
                   f"{r['rows'][1]['decode_tokens_per_second']:.2f}", load(r["environment"])])
    lines += _side_table(
        "bf16 decode before the AMX decode kernel (MLA decode attention in PyTorch's fused SDPA, cpu_decode_amx.c "
        "since the session of 2026-11-25 19:58), the same settings measured earlier:",
        ["setting", "MLA tok/s", "source tok/s", "speedup", "ideal", "speedup / ideal", "load"],
        results.get("history_sdpa_decode", {}),
        lambda r: [f"{r['rows'][0]['decode_tokens_per_second']:.2f}", f"{same_cache(r)['decode_tokens_per_second']:.2f}",
                   f"{r['rows'][0]['speedup_vs_source']:.2f}", f"{r['rows'][0]['ideal_speedup']:.2f}",
                   f"{r['rows'][0]['fraction_of_ideal']:.2f}", load(r["environment"])])
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")
    _plot(rows, stem)


def _side_table(caption: str, columns: list[str], runs: dict, cells) -> list[str]:
    """A captioned Markdown table below the main one, a line per run of ``runs`` ({name: run}): its name,
    then ``cells(run)``; nothing when there are no runs."""
    if not runs:
        return []
    return ["", caption, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns),
            *(f"| {name} | " + " | ".join(cells(r)) + " |" for name, r in runs.items())]


def _plot(rows: list[dict], stem: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if not r["name"].endswith("-prefill"):  # the long prefill settings repeat a decode context of the grid
            groups.setdefault((r["budget"], r["dtype"], r["batch"]), []).append(r)
    cols = min(4, len(groups))
    fig, axes = plt.subplots(-(-len(groups) // cols), cols, figsize=(4.2 * cols, 3.6 * -(-len(groups) // cols)),
                             squeeze=False)
    for ax in axes.flat[len(groups):]:
        ax.set_visible(False)
    for ax, ((budget, dtype, batch), rs) in zip(axes.flat, sorted(groups.items())):
        by_linears: dict[str, list[dict]] = {}
        for r in sorted(rs, key=lambda r: r["context"]):
            by_linears.setdefault(r.get("linears", "plain"), []).append(r)
        for linears, lrs in sorted(by_linears.items()):
            ctx = [r["context"] for r in lrs]
            src = [max(x["decode_tokens_per_second"] for x in r["rows"][1:]) for r in lrs]
            ideal = [s * r["rows"][0]["ideal_speedup"] for s, r in zip(src, lrs)]
            style = "-" if linears == "packed" else ":"
            ax.plot(ctx, src, "o" + style, color="C0", label=f"source (best stock cache; {linears} run)")
            ax.plot(ctx, [r["rows"][0]["decode_tokens_per_second"] for r in lrs], "s" + style, color="C1",
                    label=f"MLA {budget}%, {linears} linears")
            ax.plot(ctx, ideal, "k" + ("--" if linears == "packed" else ":"), label=f"ideal ({linears} run)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context tokens")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"{budget}% cache, {dtype}, batch {batch}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{stem}.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="run only these settings (comma-separated names as in SETTINGS)")
    parser.add_argument("--report", action="store_true", help="only rewrite the table and plot")
    parser.add_argument("--redo", action="store_true", help="run settings already in the JSON again")
    parser.add_argument("--stem", default=STEM, help=f"results file stem under benchmarks/results (default {STEM})")
    parser.add_argument("--unfitted", action="store_true",
                        help="convert with --fit-steps 0 (same shapes and speed; minutes instead of the fit's)")
    args = parser.parse_args()
    json_path = RESULTS / f"{args.stem}.json"
    results = load_json(json_path) or {"settings": {}}
    if not args.report:
        env = machine()
        results["machine"] = f"{env['machine']}, torch {env['torch']}, transformers {env['transformers']}"
        only = args.only.split(",") if args.only else None
        unknown = set(only or ()) - {s["name"] for s in SETTINGS}
        if unknown:
            raise SystemExit(f"unknown setting(s) {sorted(unknown)}; one of: {', '.join(s['name'] for s in SETTINGS)}")
        todo = [s for s in SETTINGS if (only is None or s["name"] in only)
                and (args.redo or only or s["name"] not in results["settings"])]
        for setting in todo:
            print(f"== {setting['name']}", file=sys.stderr, flush=True)
            _keep_sdpa_decode(results, setting["name"])
            results["settings"][setting["name"]] = run_setting(setting, fitted=not args.unfitted)
            save_json(json_path, results, sort_keys=False, default=str, newline=True)
    write_report(results, args.stem)


if __name__ == "__main__":
    main()
