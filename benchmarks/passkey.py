"""Passkey retrieval (issue 34) on the built-in SmolLM2-135M and its TransMLA conversions at 50% and 25%.

Each model runs `transmla eval MODEL --task passkey --lengths N --depths 10,50,90 --keys 3 --seed 0 --json`
as a user runs it (one process per model and length, so a later run can add a length): a random 5-digit
key stated once inside the built-in wiki/lee evaluation prose, at 10/50/90% of prompts of N tokens,
asked for at the end, found when the greedy answer through the model's own cache (the latent cache and
the CPU kernels for the conversions) holds it. The conversions are the CLI defaults in the native
shape, `transmla convert smollm2-135m OUT --method transmla --kv-budget 0.5 --per-layer-rope` (and 0.25;
and 0.5 in the exportable shape, `--shared-rope`, the CLI's default since issue 35), kept under
out/passkey/ and reused when present (timed with /usr/bin/time when this script makes them; one at a
time, never in parallel).

    .venv/bin/python -m benchmarks.passkey                   # 1K, 2K, 4K (the cells not yet in the JSON)
    .venv/bin/python -m benchmarks.passkey --lengths 8K      # add 8K
    .venv/bin/python -m benchmarks.passkey --only source     # some models only
    .venv/bin/python -m benchmarks.passkey --report          # only rewrite the Markdown and the plot

Writes benchmarks/results/passkey_smollm2.{json,md,png}, with the CPU (lscpu's model name) and the load
average before and after every run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

from transmla.eval.passkey import parse_lengths, passkey_rows, plot_passkey

from .common import RESULTS, ROOT, TRANSMLA, ResultCache, log, machine, measured, timed

OUT = ROOT / "out" / "passkey"
STEM = "passkey_smollm2"
JSON_PATH = RESULTS / f"{STEM}.json"
MODEL = "smollm2-135m"
DEPTHS = "10,50,90"
KEYS = 3
SEED = 0
DEFAULT_LENGTHS = "1K,2K,4K"
CONTEXT = 8192  # SmolLM2's max_position_embeddings
MODELS = {  # role -> (method, kv budget, exportable shape: --shared-rope, else --per-layer-rope); None: the source
    "source": None,
    "transmla 50%": ("transmla", 0.5, False),
    "transmla 50% exportable": ("transmla", 0.5, True),
    "transmla 25%": ("transmla", 0.25, False),
    "transmla 25% exportable": ("transmla", 0.25, True),  # the CLI's default 25% since issue 35
    "mha2mla 25%": ("mha2mla", 0.25, None),  # the published method as our CLI makes it (training-free)
}
# Conversions made elsewhere (role -> (the model folder, under the repository root; what it is)): measured when the
# folder exists, never made here (minutes to an hour of CPU each; what it is says how it was made).
SAVED = {
    # recipes/smollm2_cpu_distill_long.yaml on the saved "transmla 25% exportable, fit without repeats"
    # (model.path instead of model.source + convert: the same conversion, not made twice)
    "transmla 25% exportable + distill": (
        "out/exp/ft-distill25-long/model",
        "the saved transmla 25% exportable, fit without repeats, healed by `transmla finetune "
        "recipes/smollm2_cpu_distill_long.yaml` (its MLA projections distilled from the source, 120 steps of 1024 wiki "
        "tokens)"),
    # the spread between two conversions a user could equally get (retrieval_ladder rope-64+fit-cli-seed1): the
    # table's transmla 50% exportable is seed 0's
    "transmla 50% exportable on seed 1": (
        "out/ladder/rope-64+fit-cli-seed1",
        "the CLI's 50% exportable conversion with `--seed 1` (other calibration and fit sequences, another order of "
        "the fit's steps), written by `python -m benchmarks.retrieval_ladder --only rope-64+fit-cli-seed1 --save`"),
    # healing on stated facts with o_proj, 240 steps (retrieval_ladder rope-64+fit-cli(-seed1)+distill-facts-attn-240)
    "transmla 50% exportable + facts heal": (
        "out/exp/ft-heal50fa2/model",
        "the table's transmla 50% exportable healed by `transmla finetune recipes/smollm2_cpu_heal_facts.yaml --set "
        "train.trainable=attention` (120 steps), then again from that with `--set train.seed=1` (240 steps in all)"),
    "transmla 50% exportable on seed 1 + facts heal": (
        "out/exp/ft-heal50fa2-s1/model",
        "transmla 50% exportable on seed 1 healed as transmla 50% exportable + facts heal (240 steps in all)"),
}


def saved_folder(role: str) -> Path:
    """The folder of a SAVED role; a one-line exit when it is not on this machine (it is never made here)."""
    folder, what = SAVED[role]
    if not (ROOT / folder / "config.json").is_file():
        raise SystemExit(f"{role}: {folder} holds no model on this machine ({what})")
    return ROOT / folder


# Measured before the output fit moved from 1024 x 64 to 64 x 1024 tokens (issue 34): kept in the table,
# never run again (today's CLI makes the conversions above instead).
EARLIER = ("transmla 50%, fit 1024 x 64", "transmla 50% exportable, fit 1024 x 64", "transmla 25% exportable, fit 1024 x 64",
           # before the fit sequences had a span repeated in them (issue 34: cli-25+fit-repeat in retrieval_ladder)
           "transmla 25% exportable, fit without repeats", "transmla 50% exportable, fit without repeats",
           # one span repeated per fit sequence (two since 2026-11-27: retrieval_ladder cli-25+fit-repeat2, rope-64+fit-repeat2)
           "transmla 25% exportable, one repeated span", "transmla 50% exportable, one repeated span",
           # the 50% fit before its far term (2026-11-27: retrieval_ladder rope-64+fit-repeat2-far256-mid)
           "transmla 50% exportable, no far term",
           # the far term at weight 1 (its first weight, 2026-11-27; then 2: retrieval_ladder rope-64+fit-repeat2-far256-mid-w2)
           "transmla 50% exportable, far weight 1",
           # the 25% fit before its relative rates (2026-11-27 night: retrieval_ladder cli-25+fit-rel200-q256)
           "transmla 25% exportable, constant-rate fit",
           # the 25% conversion with RoRoPE's real rotation (the unitary one since 2026-11-28: retrieval_ladder
           # cli-25-unitary+fit)
           "transmla 25% exportable, real rotation")


# The CPU of the runs made before each row recorded its own (every one of them ran on this Xeon).
XEON = "Intel(R) Xeon(R) Processor"


def runs_by_cpu(runs: dict, default: str | None = None) -> str:
    """'CPU: key, key; CPU: ...' for the run rows {key: row} (a row without its "cpu": default)."""
    by_cpu: dict[str, list[str]] = {}
    for k, v in runs.items():
        by_cpu.setdefault(v.get("cpu", default), []).append(k)
    return "; ".join(f"{cpu}: {', '.join(sorted(keys))}" for cpu, keys in by_cpu.items())


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "unknown")


def convert_command(method: str, budget: float, shared: bool | None, out: Path) -> list[str]:
    rope = [] if shared is None else ["--shared-rope" if shared else "--per-layer-rope"]
    return [str(TRANSMLA), "convert", MODEL, str(out), "--method", method, "--kv-budget", str(budget), *rope]


def _convert_key(method: str, budget: float, shared: bool | None) -> str:
    return "convert/" + ("" if method == "transmla" else f"{method}-") + f"{budget:g}" + ("-shared" if shared else "")


def converted(method: str, budget: float, shared: bool | None, cache: ResultCache) -> Path:
    """The CLI-default conversion at `budget`, made (timed) unless out/passkey holds it already."""
    stem = f"{method}-{round(budget * 100)}" + ("-shared" if shared else "")
    out = OUT / stem
    log_file = OUT / f"{stem}.log"
    key = _convert_key(method, budget, shared)
    command = convert_command(method, budget, shared, out)
    if not (out / "config.json").is_file():
        OUT.mkdir(parents=True, exist_ok=True)
        log(f"converting: {' '.join(command)}")
        cache.results[key] = timed(command, log_file) | {"cpu": cpu_name()}
        cache.save()
    elif key not in cache.results and log_file.is_file() and "Elapsed (wall clock)" in log_file.read_text():
        # made by hand with the same command under /usr/bin/time -v, on this machine
        cache.results[key] = measured(log_file) | {"cpu": cpu_name()}
        cache.save()
    if key in cache.results:
        cache.results[key]["command"] = " ".join(["transmla", *convert_command(method, budget, shared, Path("OUT"))[1:]])
    return out


def run_length(spec: str, length: int, threads: int) -> dict:
    """One model at one prompt length: the CLI's JSON entry, with the load around it."""
    cmd = [str(TRANSMLA), "eval", spec, "--task", "passkey", "--lengths", str(length), "--depths", DEPTHS,
           "--keys", str(KEYS), "--seed", str(SEED), "--json"]
    before, start, cpu = os.getloadavg(), time.perf_counter(), os.times()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | {"OMP_NUM_THREADS": str(threads)})
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr.strip().splitlines()[-1:]}")
    after = os.times()
    (entry,) = json.loads(proc.stdout)["models"]
    return entry | {"threads": threads, "cpu": cpu_name(), "wall_s": round(time.perf_counter() - start, 1), "load_before": before,
                    "load_after": os.getloadavg(),
                    "cpu_s": round(after.children_user + after.children_system - cpu.children_user - cpu.children_system, 1)}


def run(lengths: list[int], roles: list[str], threads: int) -> dict:
    cache = ResultCache(JSON_PATH)
    cache.results["cpu"] = cpu_name()
    cache.results["machine"] = machine()
    saved = {role: str(saved_folder(role)) for role in SAVED if role in roles}  # before any conversion starts
    specs = {role: MODEL if shape is None else str(converted(*shape, cache)) for role, shape in MODELS.items()
             if role in roles} | saved
    measure_lengths(cache, specs, lengths, threads)
    return cache.results


def measure_lengths(cache: ResultCache, specs: dict[str, str], lengths: list[int], threads: int) -> None:
    """Every (role, length) cell not yet in the cache at this thread count, saved as it finishes."""
    for length in lengths:
        for role, spec in specs.items():
            key = f"{role}/{length}"
            if cache.results.get(key, {}).get("threads") != threads:
                log(f"{role} at {length} tokens, {threads} thread(s) ...")
                cache.results[key] = run_length(spec, length, threads)
                cache.save()
                entry = cache.results[key]
                log(f"{key}: {entry['found']}/{entry['keys']} found, " + ", ".join(
                    f"{c['depth']:g}%: {c['found']}/{c['keys']} in {c['seconds']:.1f} s" for c in entry["cells"]))


def merged(data: dict, role: str) -> dict | None:
    """The role's entries of every length, as one passkey entry."""
    parts = [v for k, v in sorted(data.items(), key=lambda kv: str(kv[0])) if k.startswith(f"{role}/") and isinstance(v, dict)]
    if not parts:
        return None
    cells = sorted((c for p in parts for c in p["cells"]), key=lambda c: (c["length"], c["depth"]))
    found, keys = sum(c["found"] for c in cells), sum(c["keys"] for c in cells)
    return {"model": parts[0]["model"], "role": role, "attention": parts[0]["attention"], "cells": cells,
            "found": found, "keys": keys, "accuracy": found / keys, "seconds": round(sum(c["seconds"] for c in cells), 1)}


def _threads(data: dict) -> str:
    threads = sorted({v.get("threads") for k, v in data.items() if "/" in k and isinstance(v, dict) and "found" in v},
                     key=str)
    return "threads: " + ", ".join(map(str, threads)) + " (OMP_NUM_THREADS of each eval)"


def report(data: dict) -> None:
    from transmla.eval.formatting import md_table

    entries = [e for e in (merged(data, role) for role in [*MODELS, *SAVED, *EARLIER]) if e is not None]
    png = plot_passkey(entries, RESULTS / f"{STEM}.png")
    header, rows = passkey_rows(entries)
    skipped = {e["role"]: [n for n in (1024, 2048, 4096, 8192) if n <= CONTEXT and n not in {c["length"] for c in e["cells"]}]
               for e in entries}
    runs = [v for k, v in data.items() if "/" in k and isinstance(v, dict) and "load_before" in v and "found" in v]
    loads = [x for r in runs for x in (r["load_before"][0], r["load_after"][0])]
    env = data["machine"]
    lines = [
        "# Passkey retrieval: SmolLM2-135M and its TransMLA and MHA2MLA conversions (CLI defaults)",
        "",
        "Made by `python -m benchmarks.passkey` (issue 34). Each model runs `transmla eval MODEL --task passkey "
        f"--lengths N --depths {DEPTHS} --keys {KEYS} --seed {SEED} --json`: a random 5-digit key stated once "
        "(\"The pass key is 41729. Remember it. 41729 is the pass key.\") inside the built-in wiki and lee "
        "evaluation prose (a different starting paragraph per key), starting at 10/50/90% of a prompt of exactly N "
        "tokens, asked for at the end (\"What is the pass key? The pass key is\"); found = the greedy 8-token answer, "
        "through the model's own cache (the latent cache and the CPU kernels for the conversions), holds the key. "
        "The same seeded keys and filler for every model. fp32.",
        "",
        "Models: the source (`smollm2-135m`, GQA, 384 cached elements per token per layer); "
        + "; ".join(f"{role}: `{data[_convert_key(*b)]['command']}`" if _convert_key(*b) in data else role
                    for role, b in MODELS.items() if b is not None)
        + "; " + ", ".join(EARLIER[:3]) + ": the same commands before the output fit moved from 1024 x 64 to 64 x 1024 "
        f"tokens (issue 34); {EARLIER[3]}, {EARLIER[4]}: the 25% and 50% commands before the fit's sequences had a "
        f"span repeated later in each (issue 34); {EARLIER[5]}, {EARLIER[6]}: the 25% and 50% commands while their fit "
        f"repeated one span per sequence (two since 2026-11-27); {EARLIER[7]}: the 50% command before its fit had "
        "the far term (attention over keys 256+ tokens back fitted too, on layers 15-24; since 2026-11-27); "
        f"{EARLIER[8]}: the 50% command while its far term had weight 1 (its first weight; 2 since the ladder's rope-64+fit-repeat2-far256-mid-w2); "
        f"{EARLIER[9]}: the 25% command while its fit's Adam had one constant rate for every tensor (relative rates, "
        "a cosine decay and 256 sampled queries since the ladder's cli-25+fit-rel200-q256, 2026-11-27)"
        + "".join(f"; {role}: {what}" for role, (_, what) in SAVED.items() if merged(data, role) is not None) + ".",
        "",
        "found / keys per cell; s: wall seconds of the cell's 3 prompts (prefill + 8 greedy tokens each), "
        f"{_threads(data)}.",
        "",
        md_table(header, rows),
        "",
        f"![passkey heatmaps]({png.name})",
        "",
    ]
    if any(skipped.values()):
        lines += ["Not measured (not run in the session that ran this, for time; `python -m benchmarks.passkey --lengths "
                  "8K` adds a length): " + "; ".join(f"{role} at {', '.join(f'{n // 1024}K' for n in ns)}"
                                                     for role, ns in skipped.items() if ns) + ".", ""]
    missing = [role for role in MODELS if merged(data, role) is None]
    if missing:
        lines += [f"Not measured: {', '.join(missing)} (its conversion did not finish in the session that ran this; "
                  "`python -m benchmarks.passkey` makes it under out/passkey and measures it).", ""]
    conv = [f"{k.split('/')[1]}: {v['wall_s']:.0f} s wall, peak RSS {v['peak_rss_gib']} GiB"
            + "".join(f" ({x})" for x in (v.get("cpu", XEON), v.get("note")) if x)
            for k, v in data.items()
            if k.startswith("convert/") and isinstance(v, dict) and "wall_s" in v]
    if conv:
        lines += ["Conversions (under /usr/bin/time, shared CPU): " + "; ".join(conv) + ".", ""]
    runs_of = {k: v for k, v in data.items() if "/" in k and isinstance(v, dict) and "found" in v}
    lines += [f"CPU of each run (the seconds differ by CPU): {runs_by_cpu(runs_of, XEON)}.", ""]
    lines += [
        f"Machine of the last run: {env['machine']}; CPU {data['cpu']}; Python {env['python']}, torch {env['torch']}, transformers "
        f"{env['transformers']}; {env['date']}. Load average (1 min) around the runs: {min(loads):.2f} to "
        f"{max(loads):.2f} on {os.cpu_count()} cores (the CPU was shared: seconds are wall time under that load).",
        "",
    ]
    (RESULTS / f"{STEM}.md").write_text("\n".join(lines))
    log(f"wrote {RESULTS / f'{STEM}.md'} and {png.name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default=DEFAULT_LENGTHS, help="prompt lengths, K = 1024 (default 1K,2K,4K)")
    parser.add_argument("--only", default=",".join(MODELS), help=f"comma-separated roles (default: all of {', '.join(MODELS)})")
    parser.add_argument("--threads", type=int, default=1, help="torch and kernel threads of each eval (default 1: "
                        "on a shared 2-core CPU two threads ran the MLA prompts about 5x slower, waiting on each other)")
    parser.add_argument("--report", action="store_true", help="only rewrite the Markdown and the plot")
    args = parser.parse_args()
    roles = [r.strip() for r in args.only.split(",")]
    if unknown := [r for r in roles if r not in MODELS and r not in SAVED]:
        parser.error(f"unknown role {unknown[0]!r}; choose from {', '.join([*MODELS, *SAVED])}")
    data = ResultCache(JSON_PATH).results if args.report else run(parse_lengths(args.lengths), roles, args.threads)
    report(data)


if __name__ == "__main__":
    main()
