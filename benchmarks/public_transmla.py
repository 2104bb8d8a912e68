"""The public TransMLA code (fxmeng/TransMLA) on the real Gemma 3 270M, beside the CLI's conversions at the same
cache per token (issue 37: "what the public TransMLA code does on the same Gemma 3, if it runs at all").

    git -C MIRROR archive 9c0d254 transmla | tar -x -C ~/.cache/transmla/transmla-public-9c0d254   # its code, once
    python3 -m venv ~/.cache/transmla/transmla-public-venv                                          # its pins, once
    ~/.cache/transmla/transmla-public-venv/bin/pip install torch==2.13.0 transformers==4.52.4 accelerate==1.3.0
    .venv/bin/python -m benchmarks.public_transmla            # every run not yet measured, then the table
    .venv/bin/python -m benchmarks.public_transmla --report   # only the table

MIRROR is a clone of fxmeng/TransMLA (commit 9c0d254; never copied into this repository). Its code pins
transformers 4.52.4 (its requirements.txt) and does not run under the transformers 5 this project needs (its
attention modules take `past_key_value`, where transformers 5 passes `past_key_values`), so it runs in a virtual
environment of its own with its pins (torch 2.13.0, the CPU wheel), in a separate process:
benchmarks/public_transmla_worker.py (its protocol in its docstring). This driver hands it the token windows (the
first W windows of 512 tokens of the wiki, lee and code evaluation parts, tokenized here: what `transmla eval
--max-windows W` scores) and the calibration paragraphs (the wiki calibration part, as benchmarks/care_peer gives
CARE: its default wikitext2 cannot be downloaded here).

Runs: public-B at the CLI's shapes for Gemma 3 (one KV head of 256: 512 cached elements per token per layer;
50%: kv_lora_rank 192 + qk_mqa_dim 64, 25%: 96 + 32), FreqFold 8 (its Gemma 2 scripts' setting; collapse =
256 / qk_mqa_dim as its converter computes it), 128 calibration sequences of 256 tokens (its defaults), fp32 on
one CPU thread; at 50% once as published (`as is`: it stops at the first forward through a replaced attention,
whatever the shape, so 25% is not run so) and at both with the one shim Gemma's decoder layers need to call the
replaced attention at all (`carry layer type`: the replacing module keeps the replaced one's is_sliding and
sliding_window; the worker's --carry-layer-type). The CLI's rows and the source's are
benchmarks/results/gemma3_270m_lossy.json's (the same windows and scoring), and the worker scores the source
again under transformers 4.52.4 as the check that both read the model alike.

Writes benchmarks/results/public_transmla_gemma3.{json,md}, with the CPU and the load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from transmla.checkpoint.resolve import cache_root

from .common import RESULTS, ResultCache, log, machine

MODEL = "gemma3-270m"
COMMIT = "9c0d254"
TEXTS = ("wiki", "lee", "code")
SEQ = 512
WINDOWS = 4  # gemma3_270m_lossy's
FREQFOLD = 8
RUNS = {  # run -> (fraction of the source's cache, kv_lora_rank, qk_mqa_dim, carry layer type)
    "public-0.5 as is": (0.5, 192, 64, False),
    "public-0.5 carry layer type": (0.5, 192, 64, True),
    "public-0.25 carry layer type": (0.25, 96, 32, True),
}
CLI_ROWS = {"transmla-0.5": "transmla-50", "transmla-0.25": "transmla-25"}  # run -> gemma3_270m_lossy's name
OUT_JSON = RESULTS / "public_transmla_gemma3.json"
OUT_MD = RESULTS / "public_transmla_gemma3.md"


def handover(path: Path, windows: int) -> None:
    """The token windows and the calibration paragraphs, in the torch file the worker reads."""
    from transformers import AutoTokenizer

    from transmla.checkpoint.resolve import resolve_model_dir
    from transmla.data.calib import tokenize_text
    from transmla.data.texts import load_text

    tok = AutoTokenizer.from_pretrained(resolve_model_dir(MODEL))
    wins = {}
    for text in TEXTS:
        ids = tokenize_text(tok, load_text(text, "eval"))
        wins[text] = ids[: windows * SEQ].view(windows, SEQ).clone()  # [W, 512]
    paragraphs = [p for p in load_text("wiki", "calib").split("\n\n") if p.strip()]
    torch.save({"windows": wins, "paragraphs": paragraphs}, path)


def run(name: str, args, cache: ResultCache) -> None:
    from transmla.checkpoint.resolve import resolve_model_dir

    fraction, rank, rope, carry = RUNS[name]
    env = machine()
    with tempfile.TemporaryDirectory() as tmp:
        data, out = Path(tmp) / "data.pt", Path(tmp) / "out.json"
        handover(data, args.windows)
        cmd = [str(args.python), str(Path(__file__).with_name("public_transmla_worker.py")), "--checkout",
               str(args.checkout), "--source", str(resolve_model_dir(MODEL)), "--data", str(data), "--rank", str(rank),
               "--rope", str(rope), "--freqfold", str(FREQFOLD), "--samples", str(args.samples), "--out", str(out),
               *(["--carry-layer-type"] if carry else [])]
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=os.environ | {"OMP_NUM_THREADS": str(args.threads)}, capture_output=True, text=True)
        seconds = round(time.perf_counter() - start, 1)
        if not out.is_file():
            raise SystemExit(f"{name}: the worker wrote nothing (exit {proc.returncode}): {proc.stderr[-2000:]}")
        row = json.loads(out.read_text())
    row |= {"fraction": fraction, "shape": f"{rank} + {rope}", "wall_seconds": seconds, "windows": args.windows,
            "commit": COMMIT, "machine": env, "load_after": round(os.getloadavg()[0], 2),
            "date": time.strftime("%Y-%m-%d %H:%M")}
    cache.results[name] = row
    cache.save()
    log(f"{name}: {row.get('failed') or row.get('final')}")


def _cell(ppl: dict | None, text: str, source: dict) -> str:
    if not ppl or text not in ppl:
        return "-"
    return f"{ppl[text]:.2f} ({ppl[text] / source[text]:.2f}x)"


def report(results: dict, windows: int) -> str:
    lossy = ResultCache(RESULTS / "gemma3_270m_lossy.json").results
    source = lossy[f"source|{windows}"]["perplexity"]
    head = ["run", "cache", "latent + rope", *TEXTS, "after partial_rope (wiki)", "what happened", "seconds", "CPU, load"]
    lines = [f"# The public TransMLA code on Gemma 3 270M, beside the CLI at the same cache per token", "",
             f"Made by `python -m benchmarks.public_transmla` (protocol in its docstring): fxmeng/TransMLA at {COMMIT}, "
             "its converter's steps (partial_rope, low_rank_qkv) and defaults, FreqFold 8, 128 x 256 calibration tokens "
             "of the built-in wiki text, fp32, in its own environment (transformers 4.52.4). Perplexity on the first "
             f"{windows} windows of 512 tokens of each evaluation part (x: over the source's, "
             "benchmarks/results/gemma3_270m_lossy.json, as are the CLI's rows).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head),
             f"| source | 100% | - | {' | '.join(f'{source[t]:.2f}' for t in TEXTS)} | - | - | - | - |"]
    for cli, key in CLI_ROWS.items():
        r = lossy.get(f"{key}|{windows}")
        if r is None:
            continue
        env = r["machine"]
        lines.append(f"| {cli} (CLI defaults) | {r['fraction']:.0%} | {r['shape']['kv_lora_rank']} + {r['shape']['rope_dim']} | "
                     f"{' | '.join(_cell(r['perplexity'], t, source) for t in TEXTS)} | - | converts | "
                     f"{round(r['convert_seconds'])} | {env['machine']}, {env['threads']} thread(s) |")
    for name, r in results.items():
        if r.get("windows") != windows:
            continue
        failed = r.get("failed")
        what = (f"fails in {failed['stage']}: {failed['error']} ({failed['where']})" if failed else
                f"runs; its attention keeps {', '.join(r.get('kept_modules', []))}: no q_norm / k_norm")
        rope = r.get("partial_rope")
        env = r["machine"]
        lines.append(f"| {name} | {r['fraction']:.0%} | {r['shape']} | {' | '.join(_cell(r.get('final'), t, source) for t in TEXTS)} | "
                     f"{_cell(rope, 'wiki', source)} | {what} | {r['wall_seconds']} | {env['machine']}, "
                     f"{env['threads']} thread(s), load {env['load_average']}-{r['load_after']} |")
    checks = [f"{n}: " + ", ".join(f"{t} {r['source'][t]:.4f}" for t in TEXTS) for n, r in results.items()
              if r.get("source") and r.get("windows") == windows]
    if checks:
        lines += ["", "The source scored by the worker under transformers 4.52.4 (the check; ours under 5.24: " +
                  ", ".join(f"{t} {source[t]:.4f}" for t in TEXTS) + "): " + "; ".join(checks) + "."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default=",".join(RUNS), help="comma-separated runs (default: all not yet measured)")
    ap.add_argument("--checkout", type=Path, default=cache_root() / f"transmla-public-{COMMIT}",
                    help="the public code's files (its transmla/ folder is imported)")
    ap.add_argument("--python", type=Path, default=cache_root() / "transmla-public-venv" / "bin" / "python",
                    help="the Python of its own environment (transformers 4.52.4)")
    ap.add_argument("--samples", type=int, default=128, help="calibration sequences of 256 tokens (its default)")
    ap.add_argument("--windows", type=int, default=WINDOWS)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--report", action="store_true", help="only rewrite the table")
    args = ap.parse_args()
    cache = ResultCache(OUT_JSON)
    if not args.report:
        for name in [n for n in args.runs.split(",") if n]:
            if name not in RUNS:
                ap.error(f"unknown run {name}; choose from {', '.join(RUNS)}")
            if name not in cache.results:
                run(name, args, cache)
    OUT_MD.write_text(report(cache.results, args.windows))


if __name__ == "__main__":
    main()
