"""Passkey retrieval (issue 34) on the real Qwen2.5-Coder-1.5B and its conversions (CLI defaults).

The same protocol as benchmarks.passkey (SmolLM2): each model runs `transmla eval MODEL --task passkey
--lengths N --depths 10,50,90 --keys 3 --seed 0 --json` as a user runs it, one process per model and length
(a later run adds a length; cells already in the JSON are kept), with the CPU and the load around every run.
The conversions are the folders benchmarks.qwen2_1p5b makes with the CLI's defaults of the day
(`transmla convert qwen2.5-coder-1.5b OUT --method transmla --kv-budget B`: exportable rope, unitary rotation
at 25%) and keeps with `--keep`, under $TRANSMLA_CACHE/bench-qwen2/transmla-B-cli; a role whose folder is
missing is skipped and said so. The model's context is 32K; on one thread of this CPU a 4K prompt of the
1.5B takes minutes, so lengths are added a few at a time.

    .venv/bin/python -m benchmarks.qwen2_1p5b --runs transmla-0.25-cli --keep   # a conversion, once
    .venv/bin/python -m benchmarks.passkey_qwen2 --lengths 1K,2K               # the cells not yet in the JSON
    .venv/bin/python -m benchmarks.passkey_qwen2 --report                      # only the Markdown and plot

Writes benchmarks/results/passkey_qwen2_1p5b.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from transmla.eval.passkey import parse_lengths, passkey_rows, plot_passkey

from .common import RESULTS, ResultCache, log, machine
from .passkey import DEPTHS, KEYS, SEED, measure_lengths, merged, runs_by_cpu
from .qwen2_1p5b import WORK

MODEL = "qwen2.5-coder-1.5b"
STEM = "passkey_qwen2_1p5b"
JSON_PATH = RESULTS / f"{STEM}.json"
CONTEXT = 32768
ROLES = {  # role -> the model eval reads (a built-in name or a converted folder)
    "source": MODEL,
    "transmla 50% exportable": WORK / "transmla-0.5-cli",
    "transmla 25% exportable": WORK / "transmla-0.25-cli",
}


def available(roles: list[str]) -> dict[str, str]:
    specs = {}
    for role in roles:
        spec = ROLES[role]
        if isinstance(spec, Path) and not (spec / "config.json").is_file():
            log(f"{role}: no folder {spec} (make it with benchmarks.qwen2_1p5b --runs ...-cli --keep); skipped")
            continue
        specs[role] = str(spec)
    return specs


def shapes() -> dict[str, str]:
    """role -> 'latent + rope' of each converted folder there is."""
    out = {}
    for role, spec in ROLES.items():
        if isinstance(spec, Path) and (spec / "config.json").is_file():
            mla = json.loads((spec / "config.json").read_text())["mla"]
            out[role] = f"{mla['kv_lora_rank']} + {mla['qk_rope_head_dim']}"
    return out


def run(lengths: list[int], roles: list[str], threads: int) -> dict:
    cache = ResultCache(JSON_PATH)
    cache.results["machine"] = machine()
    measure_lengths(cache, available(roles), lengths, threads)
    return cache.results


def report(data: dict) -> None:
    from transmla.eval.formatting import md_table

    entries = [e for e in (merged(data, role) for role in ROLES) if e is not None]
    if not entries:
        raise SystemExit(f"nothing measured yet in {JSON_PATH}")
    png = plot_passkey(entries, RESULTS / f"{STEM}.png")
    header, rows = passkey_rows(entries)
    runs = {k: v for k, v in data.items() if "/" in k and isinstance(v, dict) and "found" in v}
    loads = [x for r in runs.values() for x in (r["load_before"][0], r["load_after"][0])]
    lengths = sorted({c["length"] for e in entries for c in e["cells"]})
    missing = [n for n in (1024, 2048, 4096, 8192, 16384, 32768) if n <= CONTEXT and n not in lengths]
    lines = [
        "# Passkey retrieval: Qwen2.5-Coder-1.5B and its TransMLA conversions (CLI defaults)",
        "",
        "Made by `python -m benchmarks.passkey_qwen2` (issue 34): the protocol of benchmarks/passkey (SmolLM2): "
        f"`transmla eval MODEL --task passkey --lengths N --depths {DEPTHS} --keys {KEYS} --seed {SEED} --json`, a "
        "random 5-digit key stated once in the built-in wiki and lee evaluation prose at 10/50/90% of a prompt of N "
        "tokens, found when the greedy 8-token answer through the model's own cache holds it. fp32. Models: the "
        "source (`qwen2.5-coder-1.5b`, GQA, 2 KV heads of 128: 512 cached elements per token per layer) and the "
        "CLI's conversions, `transmla convert qwen2.5-coder-1.5b OUT --method transmla --kv-budget B` (exportable "
        "rope" + "".join(f"; {role}: latent + rope {w}" for role, w in shapes().items()) + ").",
        "",
        f"found / keys per cell; s: wall seconds of the cell's {KEYS} prompts (prefill + 8 greedy tokens each).",
        "",
        md_table(header, rows),
        "",
        f"![passkey heatmaps]({png.name})",
        "",
        "Models measured: " + ", ".join(f"{e['role']} ({e['found']}/{e['keys']} found)" for e in entries) + "; not measured: "
        + (", ".join(r for r in ROLES if merged(data, r) is None) or "none") + ". Lengths not yet run: "
        + (", ".join(f"{n // 1024}K" for n in missing) or "none") + " (`--lengths` adds them; one thread of this CPU "
        "takes minutes per 4K prompt of the 1.5B).",
        "",
        f"CPU of each run: {runs_by_cpu(runs)}. Load average (1 min) around the runs: {min(loads):.2f} to "
        f"{max(loads):.2f} on {os.cpu_count()} cores; threads per eval: "
        + ", ".join(sorted({str(r.get('threads')) for r in runs.values()})) + ".",
        "",
    ]
    (RESULTS / f"{STEM}.md").write_text("\n".join(lines))
    log(f"wrote {RESULTS / f'{STEM}.md'} and {png.name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="1K,2K", help="prompt lengths, K = 1024 (default 1K,2K)")
    parser.add_argument("--only", default=",".join(ROLES), help=f"comma-separated roles (default: all of {', '.join(ROLES)})")
    parser.add_argument("--threads", type=int, default=1, help="torch and kernel threads of each eval (default 1)")
    parser.add_argument("--report", action="store_true", help="only rewrite the Markdown and the plot")
    args = parser.parse_args()
    roles = [r.strip() for r in args.only.split(",")]
    if unknown := [r for r in roles if r not in ROLES]:
        parser.error(f"unknown role {unknown[0]!r}; choose from {', '.join(ROLES)}")
    data = ResultCache(JSON_PATH).results if args.report else run(parse_lengths(args.lengths), roles, args.threads)
    report(data)


if __name__ == "__main__":
    main()
