"""Healing the real Qwen2.5-Coder-1.5B at 25% of its KV cache: what a brief distillation recovers per CPU-hour.

    .venv/bin/python -m benchmarks.qwen2_1p5b --runs transmla-0.25-cli --keep   # the conversion, once (or convert it
                                                                                # to $TRANSMLA_CACHE/bench-qwen2/transmla-0.25-cli)
    .venv/bin/python -m benchmarks.heal_qwen2                 # heal (recipes/qwen2_1p5b_cpu_heal.yaml), evaluate both
    .venv/bin/python -m benchmarks.heal_qwen2 --only converted   # only the unhealed folder's row (e.g. on the other core)
    .venv/bin/python -m benchmarks.heal_qwen2 --report

The conversion is the CLI's 25% (`transmla convert qwen2.5-coder-1.5b OUT --method transmla --kv-budget 0.25`,
exportable 96 + 32, the defaults of the day) kept by benchmarks.qwen2_1p5b. Healing runs as a user runs it:
`transmla finetune recipes/qwen2_1p5b_cpu_heal.yaml --set model.path=CONVERTED --set output_dir=OUT` under
`/usr/bin/time -v` (wall time, peak RSS): the MLA projections distilled from the source (KL per token) on
1024-token pieces of the wiki calibration text, bf16 on a CPU whose bf16 products are fast. Nothing is chosen
here: the recipe's settings are the SmolLM2 healing recipe's (smollm2_cpu_heal.yaml: lr 3e-4, cosine, 1 x 1024
tokens a step) with a step budget of about an hour on one core, and the numbers say what that buys.

Both folders are evaluated alike, fp32, as benchmarks.qwen2_1p5b evaluates (`transmla eval FOLDER --data
wiki|lee|code|LICENCES --max-windows 16`: 512-token windows of the evaluation parts, never trained on; the
licences are a domain no calibration and no healing text has). Per text:

    gap recovered = (ppl_converted - ppl_healed) / (ppl_converted - ppl_source)

and that fraction per CPU-hour of the healing run. The source's perplexities are read from
benchmarks/results/qwen2_1p5b.json (the same windows). Writes benchmarks/results/heal_qwen2_1p5b.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .common import RESULTS, ROOT, TRANSMLA, ResultCache, load_json, log, machine, timed
from .qwen2_1p5b import OUT_JSON as QWEN2_JSON
from .qwen2_1p5b import TEXTS, WORK, evaluate_texts

RECIPE = ROOT / "recipes" / "qwen2_1p5b_cpu_heal.yaml"
CONVERTED = WORK / "transmla-0.25-cli"
HEALED = WORK / "heal-0.25"
OUT_JSON = RESULTS / "heal_qwen2_1p5b.json"
OUT_MD = RESULTS / "heal_qwen2_1p5b.md"


def evaluated(folder: Path, windows: int, entry: dict, results: ResultCache, key: str) -> dict:
    """Every text of TEXTS scored on `folder`, each saved as soon as it is measured (a stopped run resumes)."""

    def save(e: dict) -> None:
        results.results[key] = e
        results.save()

    return evaluate_texts(folder, folder.name, windows, entry, after_each=save)


def heal(steps: int | None) -> dict:
    """The recipe run on the converted folder, timed; its own log and metrics beside the cost."""
    if not (CONVERTED / "config.json").is_file():
        raise SystemExit(f"no conversion at {CONVERTED}: make it with benchmarks.qwen2_1p5b --runs transmla-0.25-cli --keep")
    args = [str(TRANSMLA), "finetune", str(RECIPE), "--force", "--set", f"model.path={CONVERTED}", "--set", f"output_dir={HEALED}"]
    if steps is not None:
        args += ["--set", f"train.steps={steps}"]
    WORK.mkdir(parents=True, exist_ok=True)
    log(f"healing: {' '.join(args[1:])}")
    cost = timed(args, WORK / "heal-0.25.log")
    metrics = json.loads((HEALED / "metrics.json").read_text())
    train = metrics["train_log"]
    return {"command": " ".join(["transmla", *args[1:]]), "cost": cost, "steps": train[-1]["step"] if train else 0,
            "train_log": train, "eval_log": metrics["eval_log"]}


def report(results: dict) -> str:
    source = next((e for k, e in load_json(QWEN2_JSON).items() if k.startswith("source@16")), {})
    lines = ["# Healing the Qwen2.5-Coder-1.5B at 25% of the KV cache (distillation on a CPU)", "",
             "Made by `python -m benchmarks.heal_qwen2` (protocol in its docstring): perplexity (fp32) on the first 16 "
             "windows of 512 tokens of each text's evaluation part; in brackets the ratio to the source's. Gap recovered "
             "= (converted - healed) / (converted - source). Issue 36's goal: within 1.2x of the source on every text.", "",
             "| model | steps | " + " | ".join(TEXTS) + " | healing min (wall) | CPU-hours | peak GiB | CPU, load |",
             "|---|---|" + "---|" * len(TEXTS) + "---|---|---|---|"]
    src_cells = [f"{source[t]['perplexity']:.2f}" if t in source else "" for t in TEXTS]
    lines.append(f"| source | - | {' | '.join(src_cells)} |  |  |  | from qwen2_1p5b.json |")
    rows = sorted(results.items(), key=lambda kv: (kv[0] != "converted@16", kv[0]))
    for key, e in rows:
        cells = []
        for t in TEXTS:
            if t not in e:
                cells.append("")
                continue
            ppl = e[t]["perplexity"]
            cell = f"{ppl:.2f}" + (f" ({ppl / source[t]['perplexity']:.2f}x)" if t in source else "")
            cells.append(cell)
        m = e.get("machine", {})
        where = f"{m.get('machine')}, {m.get('threads')} thread(s), load {m.get('load_average')}"
        heal_run = e.get("heal")
        if heal_run:
            c = heal_run["cost"]
            cpu_h = c["cpu_s"] / 3600
            lines.append(f"| healed | {heal_run['steps']} | {' | '.join(cells)} | {c['wall_s'] / 60:.1f} | {cpu_h:.2f} | "
                         f"{c['peak_rss_gib']:.2f} | {where} |")
        else:
            lines.append(f"| converted (CLI 25%, 96 + 32) | - | {' | '.join(cells)} |  |  |  | {where} |")
    conv, healed = results.get("converted@16"), next((e for k, e in rows if e.get("heal")), None)
    if conv and healed and source:
        parts = []
        for t in TEXTS:
            if t in conv and t in healed and t in source:
                c, h, s = conv[t]["perplexity"], healed[t]["perplexity"], source[t]["perplexity"]
                parts.append(f"{t} {100 * (c - h) / (c - s):.0f}%")
        cost = healed["heal"]["cost"]
        hours = cost["cpu_s"] / 3600
        lines += ["", f"Gap recovered by {healed['heal']['steps']} steps ({hours:.2f} CPU-hours): " + ", ".join(parts) + "."]
    lines += ["", "Training log (step, KL): " + ", ".join(
        f"{r['step']}: {r.get('kl', r.get('loss', float('nan'))):.3f}" for r in (healed or {}).get("heal", {}).get("train_log", [])
        if r["step"] == 1 or r["step"] % 10 == 0), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=("converted", "healed"), help="one row only (default: both)")
    ap.add_argument("--steps", type=int, help="the recipe's train.steps overridden")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--report", action="store_true", help="only rewrite the Markdown")
    args = ap.parse_args(argv)
    results = ResultCache(OUT_JSON)
    if not args.report:
        if args.only in (None, "converted"):
            key = f"converted@{args.windows}"
            entry = results.results.get(key) or {"folder": str(CONVERTED), "machine": machine()}
            evaluated(CONVERTED, args.windows, entry, results, key)
        if args.only in (None, "healed"):
            key = f"healed@{args.windows}"
            entry = results.results.get(key) or {}
            if "heal" not in entry:
                entry = {"heal": heal(args.steps), "machine": machine()}
                results.results[key] = entry
                results.save()
            evaluated(HEALED / "model", args.windows, entry, results, key)
    OUT_MD.write_text(report(results.results))
    print(OUT_MD.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
