"""The multiple-choice task family (issue 34: cloze and recall, transmla.eval.choice_tasks) on the
built-in SmolLM2-135M and its CLI-default TransMLA conversions (the ones benchmarks/passkey keeps
under out/passkey/, made there when missing).

Each model runs `transmla eval MODEL --task TASK --items 100 --json` as a user runs it:
- cloze: 100 passages of the held-out wiki/lee evaluation parts, the true next sentence among 4
  (chance 25%); context up to 512 tokens;
- recall: 4 people and their cities stated once, 1024 tokens of held-out prose, then the question;
  the 4 cities are the candidates (chance 25%).

    .venv/bin/python -m benchmarks.choice_tasks              # every (model, task) not yet in the JSON
    .venv/bin/python -m benchmarks.choice_tasks --only source,transmla 50%
    .venv/bin/python -m benchmarks.choice_tasks --report

Writes benchmarks/results/choice_tasks_smollm2.{json,md} with the CPU and the load around every run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time

from .common import RESULTS, TRANSMLA, ResultCache, log, run_notes
from .passkey import EARLIER, MODEL, MODELS, SAVED, converted, cpu_name, runs_by_cpu, saved_folder

STEM = "choice_tasks_smollm2"
TASKS = {"cloze": ["--context-tokens", "512"], "recall": ["--context-tokens", "1024"]}
ITEMS = 100
SECONDS_NOTE = ("Seconds come from when each row ran: until 2026-11-27 every candidate re-ran the whole context; since then "
                "the context runs once per item, its cache shared by the candidates (the source run again then: the same "
                "scores, cloze in 65 s against 170 s, recall in 273 s against 1235 s).")


def run_one(spec: str, task: str, note: str | None) -> dict:
    before = os.getloadavg()[0]
    start = time.perf_counter()
    cmd = [str(TRANSMLA), "eval", spec, "--task", task, "--items", str(ITEMS), *TASKS[task], "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip()[-500:]}")
    entry = json.loads(proc.stdout)["models"][0]
    return entry | {"wall_seconds": round(time.perf_counter() - start, 1), "load_before": round(before, 2),
                    "load_after": round(os.getloadavg()[0], 2), "cpu": cpu_name(), "command": " ".join(cmd[1:]),
                    **({"note": note} if note else {})}


def report(results: dict) -> str:
    L = ["# Multiple-choice tasks: SmolLM2-135M and its TransMLA conversions (CLI defaults)", "",
         (__doc__ or "").split("\n\n")[1].strip(), "",
         "| model | cloze acc | cloze acc_norm | recall acc | recall acc_norm | seconds (cloze / recall) |",
         "|---|---|---|---|---|---|"]
    for role in [*MODELS, *SAVED, *EARLIER]:  # earlier conversions stay in the table, never run again
        c, r = results.get(f"{role}/cloze"), results.get(f"{role}/recall")
        if not (c or r):
            continue
        f = lambda e, k: f"{e[k]:.0%}" if e else "-"  # noqa: E731
        s = lambda e: f"{e['seconds']:.0f}" if e else "-"  # noqa: E731
        L.append(f"| {role} | {f(c, 'acc')} | {f(c, 'acc_norm')} | {f(r, 'acc')} | {f(r, 'acc_norm')} | {s(c)} / {s(r)} |")
    saved = [f"{role}: {what}" for role, (_, what) in SAVED.items() if f"{role}/cloze" in results or f"{role}/recall" in results]
    if saved:
        L += ["", "Conversions made elsewhere (benchmarks/passkey.py SAVED): " + "; ".join(saved) + "."]
    run_rows = {k: v for k, v in results.items() if k.endswith(("/cloze", "/recall"))}
    runs = list(run_rows.values())
    if runs:
        cpus = runs_by_cpu(run_rows)
        L += ["", f"CPU (2 cores) of each run: {cpus}; load {min(e['load_before'] for e in runs):.1f}-{max(e['load_after'] for e in runs):.1f} around the "
              "runs (seconds are wall time under that load and differ by CPU).", "", run_notes(run_rows)]
    L += ["", SECONDS_NOTE]
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(MODELS))
    ap.add_argument("--report", action="store_true", help="only rewrite the Markdown")
    ap.add_argument("--note", help="what the recorded CPU and load do not say (the CPU's kind, threads, what else ran), "
                                   "kept with the runs made now")
    args = ap.parse_args(argv)
    roles = [r.strip() for r in args.only.split(",")]
    if unknown := [r for r in roles if r not in MODELS and r not in SAVED]:
        ap.error(f"unknown role {unknown[0]!r}; choose from {', '.join([*MODELS, *SAVED])}")
    cache = ResultCache(RESULTS / f"{STEM}.json")
    if not args.report:
        saved = {role: str(saved_folder(role)) for role in roles if role in SAVED}  # before anything runs
        for role in roles:
            if role in saved:  # a folder made elsewhere
                spec = saved[role]
            else:
                shape = MODELS[role]  # None for the source, else (budget, exportable)
                spec = MODEL if shape is None else str(converted(*shape, cache))
            for task in TASKS:
                key = f"{role}/{task}"
                if key not in cache.results:
                    log(f"{key} ...")
                    cache.results[key] = run_one(spec, task, args.note)
                    cache.save()
                    log(f"{key}: acc {cache.results[key]['acc']:.0%}")
                    (RESULTS / f"{STEM}.md").write_text(report(cache.results))
    (RESULTS / f"{STEM}.md").write_text(report(cache.results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
