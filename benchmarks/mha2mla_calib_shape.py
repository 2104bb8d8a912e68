"""Does MHA2MLA's activation-aware SVD gain from short calibration sequences, as TransMLA did?

TransMLA's dev32 run (benchmarks/results/transmla_bench.md) found that the same 32,768 calibration
tokens cut into 2048 sequences of 16 beat the published 128 x 256 (and our old 64 x 512) at every
budget. This script asks the same question of MHA2MLA with its CLI defaults (high selection, joint
SVD, activation weighting, P = 4, original propagation) at 50 / 25 / 12.5% of the cache:
calibration shapes 64 x 512 (its default), 512 x 64 and 2048 x 16, all seed 0 on the wiki
calibration part, each judged on the dev32 windows (16 from the end of the wiki calibration part +
16 from the lee calibration part; no test window is read). Writes
benchmarks/results/mha2mla_calib_shape.{json,md}; `--final 2048x16` then adds the chosen shape's test
perplexities. Run:

    .venv/bin/python -m benchmarks.mha2mla_calib_shape [--threads 1]
    .venv/bin/python -m benchmarks.mha2mla_calib_shape --final 2048x16
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from transmla.convert.assemble import assemble_model
from transmla.convert.calibrate import LayerStats
from transmla.convert.mha2mla.method import DEFAULT_CALIBRATION, MHA2MLAOptions
from transmla.convert.registry import get_method
from transmla.families import attention_geometry

from .common import RESULTS, load_json, log, machine, save_json
from .smollm2 import Bench

SHAPES = [(64, 512), (512, 64), (2048, 16)]  # sequences x tokens: 32,768 tokens each
BUDGETS = [0.5, 0.25, 0.125]
EARLIER_DEFAULT = "64x512"  # mha2mla's calibration default before this measurement
TRANSMLA_DEFAULT = "activation-2048x16s0-original"  # the dev32 candidate that is TransMLA's CLI default
JSON_PATH = RESULTS / "mha2mla_calib_shape.json"
MD_PATH = RESULTS / "mha2mla_calib_shape.md"


def cli_default_model(b: Bench, stats: list[LayerStats], budget: float):
    """(model, shape): MHA2MLA with the CLI's settings (its defaults: high, joint, activation, default P)
    at this budget, through the method's own plan and layer conversion."""
    method = get_method("mha2mla")
    plan = method.plan(attention_geometry(b.config), MHA2MLAOptions(kv_budget=budget))
    layers = [method.convert_layer(plan, src, st)[0] for src, st in zip(b.sources, stats)]
    return assemble_model(b.src_dir, b.config, layers, method.describe(plan)), plan.shape


def save(data: dict, name: str) -> None:
    save_json(JSON_PATH, data)
    log(f"{name}: {data['results'][name]}")


def run(threads: int) -> dict:
    torch.set_num_threads(threads)
    b = Bench()
    data = load_json(JSON_PATH) or {"results": {}}
    data["meta"] = {**machine(), "threads": threads}
    tm = json.loads((RESULTS / "transmla_bench.json").read_text())["results"]  # dev32 numbers, same windows
    data["source"] = tm.get("dev32/source") or b.dev32_ppl(b.source_model())
    data["transmla_ours"] = {k: tm[f"dev32/{k}/{TRANSMLA_DEFAULT}"] for k in ("50%", "25%", "12.5%")
                             if f"dev32/{k}/{TRANSMLA_DEFAULT}" in tm}
    for n, t in SHAPES:
        stats = b.original_stats(n, t, 0)  # shared with the TransMLA bench's cache; high selection reads no pair norms
        overlap = b.dev_overlap(b.calib_ids(n, t, 0))
        for budget in BUDGETS:
            name = f"{budget}/{n}x{t}"
            if name in data["results"]:
                continue
            start = time.perf_counter()
            model, shape = cli_default_model(b, stats, budget)
            data["results"][name] = {
                "budget": budget, "samples": n, "seq_len": t, "rope_pairs": shape.rope_pairs,
                "kv_lora_rank": shape.kv_lora_rank, "calib_chunks_overlapping_dev_wiki": overlap,
                **b.dev32_ppl(model), "seconds": round(time.perf_counter() - start, 1),
            }
            del model
            save(data, name)
    return data


def final(threads: int, shape: tuple[int, int]) -> dict:
    """Test perplexities of one calibration shape (wiki-test 32 + 64 windows, lee-test 29), next to the
    64 x 512 numbers of the same setting in benchmarks/results/mha2mla_smollm2.json (same windows)."""
    torch.set_num_threads(threads)
    b = Bench()
    data = load_json(JSON_PATH)
    stats = b.original_stats(*shape, 0)
    for budget in BUDGETS:
        name = f"final/{budget}/{shape[0]}x{shape[1]}"
        if name in data["results"]:
            continue
        data["results"][name] = {"budget": budget, **b.final_ppl(cli_default_model(b, stats, budget)[0])}
        save(data, name)
    return data


def report(data: dict) -> None:
    meta, res = data["meta"], data["results"]
    src = data["source"]
    default = EARLIER_DEFAULT
    lines = [
        "# MHA2MLA: calibration shape of the activation-aware SVD (dev32)", "",
        f"Machine: {meta['machine']}; torch {meta['torch']}, transformers {meta['transformers']}; {meta['date']}.", "",
        "MHA2MLA with its CLI defaults (high selection, joint SVD, activation weighting, P = 4 pairs per key head, "
        "original propagation), calibrated on 32,768 tokens of the wiki calibration part (seed 0) cut into "
        "sequences of different lengths. Perplexity on the dev32 windows (16 x 512 tokens from the end of the wiki "
        "calibration part, 16 from the lee calibration part; pooled = exp of the mean NLL over both), never on "
        f"test windows. Source model: pooled {src['ppl']:.2f} (wiki {src['wiki']:.2f}, lee {src['lee']:.2f}). "
        "The chunks are drawn from the whole wiki calibration part, so a few can fall inside the dev wiki windows: "
        "the last column counts them (at most 9 x 16 = 144 or 5 x 64 = 320 of the 8,192 dev wiki tokens); the lee "
        "windows are never calibrated on and order the shapes the same way.", "",
        "| cache (R + 2gP) | calibration | dev32 pooled | wiki | lee | overlapping chunks |",
        "|---|---|---|---|---|---|",
    ]
    for budget in BUDGETS:
        for n, t in SHAPES:
            e = res.get(f"{budget}/{n}x{t}")
            if e is None:
                continue
            tag = " (earlier default)" if f"{n}x{t}" == default else (
                " (default now)" if (n, t) == DEFAULT_CALIBRATION else "")
            lines.append(f"| {round(384 * budget)} ({e['kv_lora_rank']} + {round(384 * budget) - e['kv_lora_rank']}) "
                         f"| {n} x {t}{tag} | {e['ppl']:.1f} | {e['wiki']:.1f} | {e['lee']:.1f} "
                         f"| {e['calib_chunks_overlapping_dev_wiki']} |")
        tm = data.get("transmla_ours", {}).get({0.5: "50%", 0.25: "25%", 0.125: "12.5%"}[budget])
        if tm:
            lines.append(f"| {round(384 * budget)} | TransMLA, our defaults (2048 x 16), for scale | {tm['ppl']:.1f} "
                         f"| {tm['wiki']:.1f} | {tm['lee']:.1f} | |")
    lines += ["", verdict(res, default), ""]
    finals = {k: v for k, v in res.items() if k.startswith("final/")}
    if finals:
        grid = json.loads((RESULTS / "mha2mla_smollm2.json").read_text())["settings"]
        lines += ["## Test windows", "",
                  "The same setting on the test windows (wiki-test: first 32 windows of the wiki evaluation part, "
                  "as in every other table; lee-test: its 29 windows). The 64 x 512 numbers are the grid's "
                  "(benchmarks/results/mha2mla_smollm2.json, same setting, same windows).", "",
                  "| cache | calibration | wiki-test 32 | lee-test 29 | wiki-test 64 |", "|---|---|---|---|---|"]
        for budget in BUDGETS:
            old_cell = grid.get(f"gqa|{budget}|high|joint|activation|P4")
            if old_cell:
                lines.append(f"| {round(384 * budget)} | 64 x 512 | {old_cell['wiki']['perplexity']:.1f} "
                             f"| {old_cell['lee']['perplexity']:.1f} | – |")
            for k, e in finals.items():
                if e["budget"] == budget:
                    lines.append(f"| {round(384 * budget)} | {k.split('/')[-1].replace('x', ' x ')} | {e['wiki_test_32']:.1f} "
                                 f"| {e['lee_test']:.1f} | {e['wiki_test_64']:.1f} |")
        lines.append("")
    MD_PATH.write_text("\n".join(lines) + "\n")


def verdict(res: dict, default: str) -> str:
    parts = []
    for budget in BUDGETS:
        rows = {f"{n}x{t}": res[f"{budget}/{n}x{t}"]["ppl"] for n, t in SHAPES if f"{budget}/{n}x{t}" in res}
        if default in rows and len(rows) > 1:
            best = min(rows, key=rows.get)
            parts.append(f"{round(384 * budget)}: best {best.replace('x', ' x ')} "
                         f"({(1 - rows[best] / rows[default]) * 100:.1f}% lower than 64 x 512)" if best != default
                         else f"{round(384 * budget)}: 64 x 512 is best")
    return "Per budget, lowest pooled dev32 perplexity: " + "; ".join(parts) + "." if parts else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--report", action="store_true", help="only rewrite the Markdown")
    parser.add_argument("--final", default=None, metavar="NxT", help="test perplexities of this calibration shape")
    args = parser.parse_args()
    if args.report:
        data = load_json(JSON_PATH)
    elif args.final:
        data = final(args.threads, tuple(int(x) for x in args.final.split("x")))
    else:
        data = run(args.threads)
    report(data)


if __name__ == "__main__":
    main()
