"""DeepSeek-format export of the built-in SmolLM2-135M: what the exportable rope costs, and that
stock transformers gives the native model's perplexity.

    .venv/bin/python -m benchmarks.deepseek_export_bench            # every phase (resumes from its cache)

DeepSeek engines share one rope grid theta^(-2i/d_r) in every layer. `convert --shared-rope`
keeps one RoRoPE/FreqFold component per fold group (F = d/r) at the group's first frequency.
Which component (open decision, chosen on the dev32 windows of benchmarks/smollm2.py, never on test
windows): the one with the largest expected score change (ours, "grid-score") or the one with the
largest key energy (the published TransMLA selection with F = d/r, "grid-energy", the dev
baseline). Both beside today's defaults (score selection anywhere: not exportable; their numbers
are transmla_bench.json's, same windows and calibration).
Then, at 50 / 25 / 12.5% of the cache (128+64, 64+32, 32+16), with the CLI's default calibration:
- the native model of the chosen variant, evaluated in a process that imports transmla; its
  export (`transmla export`), evaluated in a process that never imports it (stock
  DeepseekV3ForCausalLM); the source, stock too (it must equal transmla_bench's recorded source);
- wiki-test 32 windows (ANCHORS.md) and lee-test (all 29 of its windows), 512 tokens each.
Writes benchmarks/results/deepseek_export.{json,md}.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

from safetensors.torch import save_file

from transmla.convert.pipeline import method_record, write_mla_checkpoint
from transmla.convert.registry import get_method
from transmla.export.deepseek import export_deepseek
from transmla.export.options import ExportOptions

from .common import RESULTS, log, machine, stock_perplexities
from .smollm2 import BUDGETS, CACHE, SEQ, Bench, cli_defaults, ours_layers, ours_plan

WORK = CACHE / "deepseek-export"
HEAD_DIM = 64
# Plan overrides of each exportable variant (on top of the CLI defaults' plan, F = d/r).
VARIANTS = {
    "grid-score": lambda r: {"selection": "grid", "freqfold": HEAD_DIM // r},
    "grid-energy": lambda r: {"selection": "uniform", "freqfold": HEAD_DIM // r},
}
# Today's defaults (score selection anywhere: not exportable), measured by transmla_bench.py on the
# same windows with the same calibration: its dev32 and final rows are read, not re-run.
RECORDED = RESULTS / "transmla_bench.json"
DEFAULTS_DEV32 = "dev32/{budget}/activation-2048x16s0-original"
DEFAULTS_FINAL = "final/{budget}/ours"


def recorded() -> dict:
    return json.loads(RECORDED.read_text())["results"]


def dev32(b: Bench, budgets=BUDGETS) -> str:
    """Both exportable variants on dev32; returns the one with the lower summed log perplexity."""
    calib, propagate = cli_defaults()
    b.cached("dev32/source", lambda: b.dev32_ppl(b.source_model()))
    for budget, (R, r, _) in BUDGETS.items():
        if budget not in budgets:
            continue
        for name, overrides in VARIANTS.items():
            b.cached(f"export-dev32/{budget}/{name}", lambda: b.dev32_ppl(
                b.model(ours_layers(b, budget, calib, propagate, **overrides(r))[0])))
    if not all(f"export-dev32/{k}/{n}" in b.results for k in BUDGETS for n in VARIANTS):
        return "not chosen yet"
    score = {n: sum(math.log(b.results[f"export-dev32/{k}/{n}"]["ppl"]) for k in BUDGETS) for n in VARIANTS}
    return min(score, key=score.get)


def write_native(b: Bench, budget: str, name: str, overrides: dict) -> Path:
    calib, propagate = cli_defaults()
    out = WORK / f"{budget[:-1]}-{name.split()[0]}-native"
    if not (out / "config.json").exists():
        layers, infos = ours_layers(b, budget, calib, propagate, **overrides)
        plan = replace(ours_plan(budget), **overrides)
        n, t, seed = calib
        calibration = {"text": "wiki", "samples": n, "seq_len": t, "seed": seed, "tokens": n * t, "propagate": propagate}
        record = method_record(get_method("transmla"), plan, infos, calibration)
        write_mla_checkpoint(b.src_dir, b.config, out, iter(layers), record, force=True, progress=False)
    return out


def evaluate(folders: list[Path], windows: Path, import_transmla: bool) -> list[dict]:
    return stock_perplexities(folders, windows, import_transmla, cwd=WORK)


def final(b: Bench, chosen: str, budgets=BUDGETS, source: bool = True) -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    windows = WORK / "windows.safetensors"
    save_file({"wiki_test_32": b.wiki[: 32 * SEQ].view(32, SEQ).contiguous(),
               "lee_test": b.lee[: (b.lee.numel() // SEQ) * SEQ].view(-1, SEQ).contiguous()}, str(windows))
    # The source through the stock-process scoring code: equal to transmla_bench's recorded source
    # perplexity, so the recorded defaults and the numbers here share one protocol.
    if source:
        b.cached("export-final/source", lambda: evaluate([b.src_dir], windows, False)[0])
    for budget, (R, r, _) in BUDGETS.items():
        if budget not in budgets:
            continue

        def run() -> dict:
            start = time.perf_counter()
            native = write_native(b, budget, chosen, VARIANTS[chosen](r))
            exported = WORK / f"{budget[:-1]}-{chosen}-deepseek"
            result = export_deepseek(native, exported, ExportOptions(force=True), progress=False)
            nat_shared = evaluate([native], windows, True)[0]
            stock = evaluate([exported], windows, False)[0]
            assert stock["class"] == "DeepseekV3ForCausalLM" and not stock["transmla_imported"]
            return {"shared_native": nat_shared, "shared_exported": stock, "export_record": result.record,
                    "chosen": chosen, "seconds": round(time.perf_counter() - start, 1)}
        b.cached(f"export-final/{budget}", run)


def report(b: Bench, chosen: str) -> None:
    r = b.results
    texts = ("wiki_test_32", "lee_test")
    out = {"machine": machine(), "chosen_variant": chosen, "variants": list(VARIANTS),
           "results": {k: v for k, v in r.items() if k.startswith(("export-", "dev32/source"))}}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "deepseek_export.json").write_text(json.dumps(out, indent=1, sort_keys=True))
    src = r.get("export-final/source")
    lines = [
        "# DeepSeek-format export of SmolLM2-135M (training-free TransMLA, fp32)",
        "",
        f"Machine: {out['machine']['machine']}, torch {out['machine']['torch']}, transformers "
        f"{out['machine']['transformers']}. Re-run: `python -m benchmarks.deepseek_export_bench`.",
        "",
        "## Which component each fold group keeps (dev32: 16 wiki + 16 lee windows, pooled perplexity)",
        "",
        "| cache (R + r) | today's defaults (not exportable) | " + " | ".join(VARIANTS) + " |",
        "|---|---|" + "---|" * len(VARIANTS),
    ]
    rec = recorded()
    for budget, (R, rr, _) in BUDGETS.items():
        cells = [f"{rec[DEFAULTS_DEV32.format(budget=budget)]['ppl']:.2f}"]
        cells += [f"{r[f'export-dev32/{budget}/{n}']['ppl']:.2f}" if f"export-dev32/{budget}/{n}" in r else "not measured"
                  for n in VARIANTS]
        lines.append(f"| {budget} ({R} + {rr}) | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Chosen for `--shared-rope`: **{chosen}** (lower summed log perplexity over the three budgets). "
        f"Source on dev32: {r['dev32/source']['ppl']:.2f}.",
        "",
        "## Test windows: the exportable rope's cost, and the export in stock transformers",
        "",
        "Native models run in a process that imports transmla; the export and the source in one that never does "
        "(stock `DeepseekV3ForCausalLM` / `LlamaForCausalLM`). Same windows, same scoring code.",
        "",
        "| cache (R + r) | text | source | today's defaults (native) | --shared-rope (native) | its export, stock transformers | export vs native | cost of the shared rope |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for budget, (R, rr, _) in BUDGETS.items():
        e = r.get(f"export-final/{budget}")
        if e is None or src is None:
            lines.append(f"| {budget} ({R} + {rr}) | | not measured (the run was cut for time) | | | | | |")
            continue
        for t in texts:
            d = rec[DEFAULTS_FINAL.format(budget=budget)][t]
            n, x = e["shared_native"][t]["ppl"], e["shared_exported"][t]["ppl"]
            lines.append(
                f"| {budget} ({R} + {rr}) | {t} | {src[t]['ppl']:.2f} | {d:.2f} | {n:.2f} | {x:.2f} | "
                f"{100 * (x / n - 1):+.4f}% | {100 * (n / d - 1):+.1f}% |"
            )
    record = next((r[k]["export_record"] for k in r if k.startswith("export-final/") and "export_record" in r[k]),
                  {"source_rms_norm_eps": "?"})
    src = src or {t: {"ppl": float("nan")} for t in texts}
    lines += [
        "",
        f"Today's defaults: transmla_bench.json (`{DEFAULTS_DEV32}`, `{DEFAULTS_FINAL}`), same windows and "
        f"calibration. The source scored here by the stock process: wiki {src['wiki_test_32']['ppl']:.4f}, lee "
        f"{src['lee_test']['ppl']:.4f}; recorded by transmla_bench: {rec['final/source']['wiki_test_32']:.4f}, "
        f"{rec['final/source']['lee_test']:.4f} (one protocol).",
        "",
        f"The export sets rms_norm_eps to 1e-6 for every norm (the source uses {record['source_rms_norm_eps']}): "
        "transformers fixes 1e-6 for the latent norm and the other engines read one eps for all norms; the "
        "'export vs native' column includes that change.",
    ]
    (RESULTS / "deepseek_export.md").write_text("\n".join(lines) + "\n")
    log("wrote benchmarks/results/deepseek_export.{json,md}")


def main() -> None:
    b = Bench()
    if "--report-only" in sys.argv:  # what is measured so far (the cache), without measuring more
        done = [n for n in VARIANTS if all(f"export-dev32/{k}/{n}" in b.results for k in BUDGETS)]
        report(b, min(done, key=lambda n: sum(math.log(b.results[f"export-dev32/{k}/{n}"]["ppl"]) for k in BUDGETS))
               if len(done) == len(VARIANTS) else "not chosen yet")
        return
    if "--phase" in sys.argv:  # one step at a time: --phase dev32|final|source --budget 25% [--variant NAME]
        phase, budget = sys.argv[sys.argv.index("--phase") + 1], sys.argv[sys.argv.index("--budget") + 1] if "--budget" in sys.argv else None
        budgets = [budget] if budget else list(BUDGETS)
        if phase == "dev32":
            dev32(b, budgets)
        elif phase == "final":
            final(b, sys.argv[sys.argv.index("--variant") + 1], budgets, source=False)
        elif phase == "source":
            final(b, "", [], source=True)
        return
    chosen = dev32(b)
    final(b, chosen)
    report(b, chosen)


if __name__ == "__main__":
    main()
