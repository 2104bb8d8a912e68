"""The fp32 C kernels against PyTorch's SDPA on this CPU: which one the absorbed attention should run.

One layer of the built-in model's conversions (SmolLM2-135M: 9 query heads; 50% = latent 128 + rope 64,
25% = 64 + 32), one thread, fp32, random values (the cost does not depend on them): a prompt of T tokens
(causal prefill, cpu_prefill.c against sdpa_rows.sdpa_prefill) and one decode step over S cached rows
(cpu_decode.c against sdpa_rows.sdpa_decode). Best of several calls; the two results agree to fp32
rounding (max |difference| in the table). The kernels are forced here (TRANSMLA_KERNEL=cpu); the column
"auto" says what attend_rows ran on this CPU without it when the row was measured
(cpu_build.fp32_kernels_run).

    .venv/bin/python -m benchmarks.cpu_kernels                      # this CPU's rows for today's kernels
    .venv/bin/python -m benchmarks.cpu_kernels --label "16-float"   # under another label (one entry per CPU and label)

Writes benchmarks/results/cpu_kernels.{json,md} with the CPU, its vector flags and the load.
"""

from __future__ import annotations

import os
import time

from .common import RESULTS, ResultCache, log

STEM = "cpu_kernels"
HEADS = 9
SHAPES = {"50%": (128, 64), "25%": (64, 32)}  # (d_c, d_r)
PREFILL_TOKENS = (1024, 4096)
DECODE_ROWS = (4096, 16384)


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _cpu() -> dict:
    from transmla.machine import environment
    from transmla.mla.kernels.cpu_build import cpu_flags, fast_vectors

    name = environment()["machine"].split("(", 1)[1].rsplit(",", 1)[0]  # the model name, as every report gives it
    vectors = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in cpu_flags()]
    return {"cpu": name, "cores": os.cpu_count(), "vector_flags": vectors, "auto": "kernel" if fast_vectors() else "SDPA"}


def measure() -> dict:
    import torch

    os.environ["TRANSMLA_KERNEL"] = "cpu"
    from transmla.mla.kernels import cpu_decode, cpu_prefill
    from transmla.mla.kernels.sdpa_rows import sdpa_decode, sdpa_prefill

    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows_out = []
    load = [os.getloadavg()[0]]
    with torch.inference_mode():
        for budget, (d_c, d_r) in SHAPES.items():
            W = d_c + d_r
            cases = [("prefill", n, torch.randn(1, n, HEADS, W), torch.randn(1, n, W)) for n in PREFILL_TOKENS]
            cases += [("decode", n, torch.randn(1, 1, HEADS, W), torch.randn(1, n, W)) for n in DECODE_ROWS]
            for phase, n, q, rows in cases:
                kernel = cpu_prefill.mla_prefill_cpu if phase == "prefill" else cpu_decode.mla_decode_cpu
                sdpa = sdpa_prefill if phase == "prefill" else sdpa_decode
                a, b = kernel(q, rows, d_c, 0.1), sdpa(q, rows, d_c, 0.1)
                repeats = 3 if phase == "prefill" else 20
                k_s, s_s = _best(lambda: kernel(q, rows, d_c, 0.1), repeats), _best(lambda: sdpa(q, rows, d_c, 0.1), repeats)
                row = dict(shape=budget, d_c=d_c, d_r=d_r, phase=phase, tokens=n, kernel_ms=round(k_s * 1e3, 3),
                           sdpa_ms=round(s_s * 1e3, 3), kernel_over_sdpa=round(k_s / s_s, 2),
                           max_abs_diff=float((a - b).abs().max()))
                log(str(row))
                rows_out.append(row)
    load.append(os.getloadavg()[0])
    return {**_cpu(), "rows": rows_out, "load": [round(x, 2) for x in load], "threads": 1,
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def report(results: dict) -> str:
    L = ["# The fp32 CPU kernels against PyTorch's SDPA, per CPU", "",
         __doc__.split("\n\n")[1].replace("\n", " "), "",
         "| CPU, kernels | vector flags | shape | phase | tokens | kernel ms | SDPA ms | kernel / SDPA | max diff | auto ran |",
         "|---|---|---|---|---|---|---|---|---|---|"]
    for key, r in sorted(results.items()):
        for row in r["rows"]:
            L.append(f"| {key} | {' '.join(r['vector_flags'])} | {row['shape']} ({row['d_c']} + {row['d_r']}) | "
                     f"{row['phase']} | {row['tokens']} | {row['kernel_ms']:.2f} | {row['sdpa_ms']:.2f} | "
                     f"{row['kernel_over_sdpa']:.2f} | {row['max_abs_diff']:.1e} | {r['auto']} |")
    L += [""] + [f"{cpu}: {r['cores']} cores, {r['threads']} thread, load {r['load'][0]}-{r['load'][1]}, torch {r['torch']}, "
                 f"{r['date']}." for cpu, r in sorted(results.items())]
    L += ["", "Kernels: \"16-float\" are the kernels written for AVX-512 alone (16-float vectors everywhere; GCC "
          "lowers them through the stack on an AVX2 CPU, which made them 2-9x slower than SDPA there); "
          "\"per-width\" are today's, whose vectors and register tiles follow the CPU (cpu_vector.h: 16 floats "
          "with AVX-512, 8 with AVX2)."]
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", default="per-width", help="the kernels' label in the table (default: per-width)")
    args = ap.parse_args(argv)
    cache = ResultCache(RESULTS / f"{STEM}.json")
    result = measure()
    cache.results[f"{result['cpu']}, {args.label}"] = result
    cache.save()
    (RESULTS / f"{STEM}.md").write_text(report(cache.results))
    log(f"wrote {RESULTS / STEM}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
