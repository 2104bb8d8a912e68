"""Where a decode step's time goes: torch's profiler over decode steps of the converted built-in model
and of its source (issue 17's profile, repeated as `transmla bench generate --profile-steps` does it).

    .venv/bin/python -m benchmarks.decode_profile              # every setting, then the report
    .venv/bin/python -m benchmarks.decode_profile --unfitted   # models converted with --fit-steps 0

Issue 17 profiled 4 decode steps of the 25% TransMLA conversion at 2K context, batch 1, fp32: `bmm` of
the reference decode's einsums 39%, `cat` 18% (the cache grew by concatenation), `masked_fill` 14% (the
whole latent cache copied to mask it), `copy_` 13%. Each setting here is one bench_generate call with
PROFILE_STEPS profiled steps after one timed repetition, the MLA model (the converted_model of
generate_bench) against the source with a StaticCache (its faster stock cache at these contexts), one
thread each. The C kernels show as transmla::cpu_decode_kernel (kernels/backends.py names them).

Writes benchmarks/results/decode_profile.json and decode_profile.md (the machine and load with them).
"""

from __future__ import annotations

import argparse

from transmla.bench.generate import bench_generate

from .common import RESULTS, machine, save_json
from .generate_bench import BUDGETS, SOURCE, THREADS, converted_model

PROFILE_STEPS = 8
SETTINGS = [  # (budget, dtype, batch, context)
    ("25", "fp32", 1, 2048),  # the profile
    ("25", "fp32", 8, 8192),
    ("25", "bf16", 1, 8192),
]


def run(fitted: bool) -> dict:
    results = {"machine": machine(), "profile_steps": PROFILE_STEPS, "settings": {}}
    for budget, dtype, batch, context in SETTINGS:
        assert budget in BUDGETS
        name = f"{budget}-{dtype}-b{batch}-{context // 1024}k"
        print(f"== {name}", flush=True)
        result = bench_generate(str(converted_model(budget, fitted)), SOURCE, batch=batch, context=context,
                                new_tokens=4, dtype=dtype, device="cpu", repeats=1, prefill=False,
                                source_caches=("static",), beyond_positions=True, threads=THREADS, progress=True,
                                profile_steps=PROFILE_STEPS)
        results["settings"][name] = {"fitted": fitted, **result}
        save_json(RESULTS / "decode_profile.json", results, sort_keys=False, default=str, newline=True)
    return results


def write_report(results: dict) -> None:
    m = results["machine"]
    lines = [
        "# Where a decode step's time goes (torch's profiler)",
        "",
        f"Made by `python -m benchmarks.decode_profile` (see its docstring): {results['profile_steps']} decode steps "
        "per model after a random fill of the cache, one thread, self time per op (ms per step and share of the "
        "profiled step, the profiler's overhead included); `(outside torch ops)` is the step's time in no op "
        "(Python, the models' glue).",
        "",
        f"Machine: {m['machine']}, torch {m['torch']}, transformers {m['transformers']}.",
        "",
    ]
    for name, r in results["settings"].items():
        env = r["environment"]
        lines += [f"## {name}" + ("" if r.get("fitted", True) else " (model converted with --fit-steps 0)"), "",
                  f"Load {env['load_average']} -> {env['load_average_after']}.", ""]
        for row in r["rows"]:
            prof = row["profile"]
            what = "MLA" if row["attention"] == "MLA" else f"source ({row['cache']} cache)"
            lines += [f"{what}: {prof['ms_per_step']:.1f} ms a step profiled, {row['ms_per_step']:.1f} ms timed "
                      f"(decode attention: {row.get('decode_attention', '-')}).", "",
                      "| op | ms/step | share |", "|---|---|---|"]
            lines += [f"| {op['op']} | {op['ms_per_step']:.2f} | {op['share']:.0%} |" for op in prof["ops"]]
            lines.append("")
    (RESULTS / "decode_profile.md").write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unfitted", action="store_true", help="models converted with --fit-steps 0 (same speed)")
    write_report(run(fitted=not parser.parse_args().unfitted))


if __name__ == "__main__":
    main()
