"""Does a brief fine-tune recover the quality a 25%-cache conversion loses?

The built-in SmolLM2-135M-Instruct, converted by TransMLA at a quarter of its KV cache (96 of
384 elements per token per layer, default options but per-layer rope, the native shape of its
results), fine-tuned by a recipe on the built-in wiki
CALIBRATION text, evaluated on the wiki EVALUATION text (ANCHORS.md protocol: non-overlapping
512-token windows, the first 32 = 16,352 scored tokens; calibration and evaluation never overlap).

    gap recovered = (ppl_converted - ppl_finetuned) / (ppl_converted - ppl_source)

Goal: at least 0.5. Writes benchmarks/results/finetune_smollm2.{json,md}, the training and evaluation
logs (CSV) and the curves (PNG). Run:

    .venv/bin/python -m benchmarks.finetune_bench                      # recipes/smollm2_cpu_bench.yaml
    .venv/bin/python -m benchmarks.finetune_bench --recipe R.yaml --set train.steps=100 --name finetune_x
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from .common import RESULTS, ROOT, machine



def source_perplexity(source: str, recipe, threads: int | None) -> dict:
    from transmla.checkpoint.resolve import load_model
    from transmla.data.texts import load_text
    from transmla.eval.perplexity import perplexity, tokenize_text

    if threads:
        torch.set_num_threads(threads)
    t0, c0 = time.perf_counter(), time.process_time()
    model, tok = load_model(source, dtype=torch.float32, device="cuda" if recipe.train.device == "cuda" else "cpu")
    ids = tokenize_text(tok, load_text(recipe.eval.data, part=recipe.eval.part))
    r = perplexity(model, ids, seq_len=recipe.eval.seq_len, max_windows=recipe.eval.final_windows, progress=False)
    del model
    return {**r.to_dict(), "wall_seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0}


def _machine() -> str:

    env = machine()
    return (f"{env['machine']}, {env['gpu'] or 'no GPU'}, torch {env['torch']}, transformers {env['transformers']}; "
            f"load average {env['load_average']:.1f} at the start")


def write_markdown(path: Path, res: dict) -> None:
    s, c, f = res["source"], res["converted"], res["finetuned"]
    t = res["training"]
    lines = [
        f"# Fine-tuning recovery: SmolLM2-135M, TransMLA at 25% of the KV cache ({res['name']})",
        "",
        f"Machine: {res['machine']}.",
        f"Recipe: `{res['recipe_file']}` ({res['command']}).",
        "",
        "Held-out text: the built-in wiki evaluation part (never trained on), "
        f"{s['windows']} non-overlapping windows x {s['seq_len']} tokens = {s['tokens']:,} scored tokens.",
        "",
        "| model | KV elements / token / layer | wiki-test perplexity |",
        "|---|---|---|",
        f"| source (GQA) | 384 | {s['perplexity']:.2f} |",
        f"| TransMLA 25%, training-free | 96 | {c['perplexity']:.2f} |",
        f"| TransMLA 25%, fine-tuned | 96 | {f['perplexity']:.2f} |",
        "",
        f"**Perplexity gap recovered: {res['gap_recovered']:.1%}** (goal: at least 50%); "
        f"in log-perplexity (NLL) terms {res['nll_gap_recovered']:.1%}.",
        "",
        f"Training: {t['steps']} steps, {t['tokens']:,} tokens of the wiki calibration part "
        f"({t['epochs']:.2f} passes over its {t['train_sequences']} packed sequences), trainable = {t['trainable']} "
        f"({t['trained_parameters']:,} of {t['total_parameters']:,} parameters), lr {t['lr']:g} {t['schedule']}, "
        f"seq {t['seq_len']}, batch {t['batch']} sequences.",
        f"Time: training run {t['wall_seconds'] / 60:.1f} min wall, {t['cpu_seconds'] / 60:.1f} min CPU "
        f"({t['tokens_per_second']:.1f} training tokens/s wall, {t['hardware']}); "
        f"the wall time is inflated by other jobs sharing the CPU.",
        "",
        "Curves: `finetune_smollm2_curves.png`; logs: `finetune_smollm2_train_log.csv`, `finetune_smollm2_eval_log.csv`.",
        "",
    ]
    if res.get("notes"):
        lines += [res["notes"], ""]
    path.write_text("\n".join(lines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="recipes/smollm2_cpu_bench.yaml")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--name", default="finetune_smollm2", help="result file stem under benchmarks/results/")
    ap.add_argument("--source", default="smollm2-135m")
    ap.add_argument("--source-ppl-json", default=None, help="reuse a source perplexity measured before (JSON of PerplexityResult)")
    ap.add_argument("--notes", default=None, help="a paragraph appended to the Markdown report")
    args = ap.parse_args()

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transmla.finetune.recipe import load_recipe
    from transmla.finetune.train import run_finetune

    recipe = load_recipe(ROOT / args.recipe if not Path(args.recipe).is_absolute() else args.recipe, args.overrides)
    machine = _machine()
    print(f"machine: {machine}", file=sys.stderr)

    if args.source_ppl_json:
        source = json.loads(Path(args.source_ppl_json).read_text())
    else:
        print("source perplexity ...", file=sys.stderr)
        source = source_perplexity(args.source, recipe, recipe.train.threads)
    print(f"source: {source['perplexity']:.3f}", file=sys.stderr)

    stale = Path(recipe.output_dir) / "checkpoints"
    if stale.is_dir():  # the benchmark measures one whole run, never the tail of an older one
        print(f"removing {stale} (a previous run's checkpoints)", file=sys.stderr)
        shutil.rmtree(stale)
    result = run_finetune(recipe)
    out = Path(recipe.output_dir)
    metrics = json.loads((out / "metrics.json").read_text())
    full = recipe.eval.final_windows
    start = next(r for r in metrics["eval_log"] if r["tag"] == "start" and r["windows"] == source["windows"])
    final = next(r for r in metrics["eval_log"] if r["tag"] == "final" and r["windows"] == source["windows"])
    assert start["tokens"] == final["tokens"] == source["tokens"], "source and converted must score the same tokens"

    gap = (start["perplexity"] - final["perplexity"]) / (start["perplexity"] - source["perplexity"])
    nll_gap = (start["nll"] - final["nll"]) / (start["nll"] - source["nll"])
    first = metrics["train_log"][0]["step"] if metrics["train_log"] else 0
    res = {
        "name": args.name,
        "machine": machine,
        "recipe_file": args.recipe,
        "command": "python -m benchmarks.finetune_bench " + " ".join(f"--set {o}" for o in args.overrides),
        "recipe": recipe.dump(),
        "source": source,
        "converted": start,
        "finetuned": final,
        "gap_recovered": gap,
        "nll_gap_recovered": nll_gap,
        "goal_met": gap >= 0.5,
        "training": {
            "steps": result.steps,
            "tokens": result.tokens,
            "epochs": result.epochs,
            "train_sequences": result.train_sequences,
            "trainable": recipe.train.trainable,
            "trained_parameters": result.trained_parameters,
            "total_parameters": result.total_parameters,
            "lr": recipe.optimizer.lr,
            "schedule": f"{recipe.schedule.kind}, warmup {recipe.schedule.warmup_steps}",
            "seq_len": recipe.data.seq_len,
            "batch": recipe.train.micro_batch_size * recipe.train.grad_accum,
            "wall_seconds": result.wall_seconds,
            "cpu_seconds": result.cpu_seconds,
            "tokens_per_second": result.tokens_per_second or float("nan"),
            "hardware": result.hardware,
            "resumed_from": result.resumed_from,
            "first_logged_step": first,
        },
        "eval_log": metrics["eval_log"],
        "eval_windows_final": full,
        "notes": args.notes,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(res, indent=1, default=str))
    for src, dst in (("curves.png", "curves.png"), ("train_log.csv", "train_log.csv"), ("eval_log.csv", "eval_log.csv")):
        if (out / src).is_file():
            shutil.copyfile(out / src, RESULTS / f"{args.name}_{dst}")
    write_markdown(RESULTS / f"{args.name}.md", res)
    print(json.dumps({k: res[k] for k in ("gap_recovered", "nll_gap_recovered", "goal_met")}
                     | {"source": source["perplexity"], "converted": start["perplexity"], "finetuned": final["perplexity"],
                        "tokens": result.tokens, "wall_min": result.wall_seconds / 60}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
