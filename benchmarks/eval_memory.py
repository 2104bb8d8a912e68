"""Peak memory of `transmla eval` as `make demo` runs it (the demo's largest step in memory until 2026-12-06).

    .venv/bin/python -m benchmarks.eval_memory                          # this checkout's code
    git worktree add /tmp/before COMMIT
    .venv/bin/python -m benchmarks.eval_memory --tree /tmp/before --label before   # another checkout's code, same venv
    .venv/bin/python -m benchmarks.eval_memory --report                 # only the Markdown

Runs `transmla eval MODEL --compare SOURCE --data wiki --max-windows W --json` (by default make demo's eval of
its 25% conversion: MODEL the folder the demo writes, out/smollm2-transmla-25, SOURCE smollm2-135m; `--model`
and `--compare` name others) under /usr/bin/time -v, with the package of TREE (`python -P` and PYTHONPATH=TREE: that checkout's transmla, this interpreter's libraries), one
thread. Records the peak RSS (GiB), wall and CPU seconds, both models' perplexities (a change that only saves
memory leaves them equal), the commit of TREE, the CPU and the load around the run; `--note` says what else ran.
Writes benchmarks/results/eval_memory.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .common import RESULTS, ResultCache, log, machine, run_notes, timed

ROOT = Path(__file__).resolve().parents[1]
STEM = "eval_memory"
SOURCE = "smollm2-135m"


def eval_json(log_text: str) -> dict:
    """The JSON document `transmla eval --json` printed, from a log that also holds /usr/bin/time's report."""
    start = log_text.index("{")
    return json.JSONDecoder().raw_decode(log_text[start:])[0]


def measure(tree: Path, model: str, source: str, windows: int) -> dict:
    commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            check=True).stdout.strip()
    cmd = ["env", f"PYTHONPATH={tree}", "OMP_NUM_THREADS=1", sys.executable, "-P", "-m", "transmla.cli.app", "eval",
           model, "--compare", source, "--data", "wiki", "--max-windows", str(windows), "--json"]
    with tempfile.TemporaryDirectory() as tmp:
        log_file = Path(tmp) / "time.log"
        cost = timed(cmd, log_file)
        doc = eval_json(log_file.read_text())
    return cost | {"commit": commit, "windows": windows, "model": model,
                   "perplexity": {doc["model"]: doc["perplexity"], doc["source"]["model"]: doc["source"]["perplexity"]},
                   "command": " ".join(cmd[4:]), "machine": machine()}


def report(results: dict) -> str:
    lines = ["# Peak memory of `transmla eval` as `make demo` runs it", "", (__doc__ or "").split("\n\n")[2].strip(), "",
             "| run | commit | windows | peak RSS GiB | wall s | CPU s | perplexities | CPU, load |", "|---" * 8 + "|"]
    runs = {k: v for k, v in results.items() if isinstance(v, dict) and "peak_rss_gib" in v}
    for label, r in runs.items():
        ppl = ", ".join(f"{Path(m).name} {p:.4f}" for m, p in r["perplexity"].items())
        m = r["machine"]
        lines.append(f"| {label} | {r['commit']} | {r['windows']} | {r['peak_rss_gib']:.3f} | {r['wall_s']} | {r['cpu_s']} | "
                     f"{ppl} | {m.get('machine')}, load {r['load_before'][0]:.1f}-{r['load_after'][0]:.1f} |")
    notes = run_notes(runs)
    return "\n".join(lines + ["", notes] if notes else lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "out" / "smollm2-transmla-25"), help="the converted model (default: make demo's)")
    ap.add_argument("--compare", default=SOURCE, help=f"the source it is compared with (default {SOURCE}, make demo's)")
    ap.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose transmla runs (default: this one)")
    ap.add_argument("--label", default="current", help="the run's row (default: current)")
    ap.add_argument("--windows", type=int, default=32, help="evaluation windows (default 32, make demo's)")
    ap.add_argument("--note", help="what the recorded CPU and load do not say (what else ran)")
    ap.add_argument("--report", action="store_true", help="only rewrite the Markdown")
    args = ap.parse_args(argv)
    cache = ResultCache(RESULTS / f"{STEM}.json")
    if not args.report:
        if not (Path(args.model) / "config.json").is_file():
            raise SystemExit(f"no converted model at {args.model} (make demo writes it)")
        log(f"{args.label}: eval with {args.tree}'s transmla ...")
        cache.results[args.label] = measure(args.tree.resolve(), args.model, args.compare, args.windows) | (
            {"note": args.note} if args.note else {})
        cache.save()
        log(f"{args.label}: peak RSS {cache.results[args.label]['peak_rss_gib']} GiB")
    (RESULTS / f"{STEM}.md").write_text(report(cache.results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
