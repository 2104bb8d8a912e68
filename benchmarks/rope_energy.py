"""How much of the keys RoRoPE keeps under RoPE: the published real rotation against the unitary one.

For every layer of SmolLM2-135M, from the CLI's calibration statistics (the gram of 2048 x 16 wiki tokens,
original propagation: the same file benchmarks.retrieval_ladder converts from), RoRoPE's PCA across the KV
heads is done twice: real (published: one real orthogonal matrix on the real and imaginary parts of a
frequency's pairs) and unitary (a complex unitary matrix; it commutes with RoPE as well, rorope.py). At the
CLI's exportable shapes (50%: rope 64 at F = 1; 25%: rope 32 at F = 2, one component per group of two
frequencies) it reports the share of the key energy E|k|^2 left in the kept rope components (the rest loses
RoPE and goes to the latent) and the expected squared logit error of the rope/NoPE split relative to the
source's logit energy (rorope.logit_error over a 512-token window: queries and keys independent). Seconds;
no model forward. Writes benchmarks/results/rope_energy.{json,md}.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

from .common import RESULTS, log, save_json

STEM = "rope_energy"
SHAPES = {"50%": dict(kv_budget=0.5), "25%": dict(kv_budget=0.25)}


def measure() -> dict:
    import torch

    from transmla.convert.options import ConvertOptions
    from transmla.convert.pipeline import LayerStream
    from transmla.convert.registry import get_method
    from transmla.convert.transmla.method import LayerMoments, choose_rope

    from .retrieval_ladder import BASE, cached_stats
    from .smollm2 import Bench

    b = Bench()
    method = get_method("transmla")
    rows = {}
    for label, shape in SHAPES.items():
        options = ConvertOptions.of(**(BASE | shape | {"fit_steps": 0}))
        stream = LayerStream(method, b.src_dir, b.config, options, progress=False)
        stats = cached_stats(b, stream)
        for rotation in ("real", "unitary"):
            plan = replace(stream.plan, rotation=rotation)
            kept_share, errors = [], []
            for src, st in zip(b.sources, stats):
                m = LayerMoments.of(src, st.gram)
                choice, _ = choose_rope(src, m, plan)
                energy = choice.rotation.energy.reshape(-1)
                kept_share.append(float(energy[choice.kept].sum() / energy.sum()))
                errors.append(choice.logit_error)
            rows[f"{label} {rotation}"] = dict(rope_dim=plan.rope_dim, fold=plan.freqfold, kept_share=kept_share,
                                               logit_error=errors)
            log(f"{label} {rotation}: key energy kept in rope {sum(kept_share) / len(kept_share):.3f}, "
                f"logit error {sum(errors) / len(errors):.4f}")
    return rows


def report(rows: dict, machine: str) -> str:
    L = ["# RoRoPE's rotation: real (published) against unitary", "", __doc__.split("\n\n", 1)[1].strip(), "",
         "| shape | rotation | key energy kept in rope: mean (min-max over layers) | relative logit error: mean (max) |",
         "|---|---|---|---|"]
    for name, r in rows.items():
        k, e = r["kept_share"], r["logit_error"]
        shape, rotation = name.split(" ")
        L.append(f"| {shape} (rope {r['rope_dim']}, F = {r['fold']}) | {rotation} | {sum(k) / len(k):.3f} "
                 f"({min(k):.3f}-{max(k):.3f}) | {sum(e) / len(e):.4f} ({max(e):.4f}) |")
    L += ["", "Per layer (key energy kept in rope):", "", "| layer | " + " | ".join(rows) + " |",
          "|---|" + "---|" * len(rows)]
    n = len(next(iter(rows.values()))["kept_share"])
    for i in range(n):
        L.append(f"| {i} | " + " | ".join(f"{r['kept_share'][i]:.3f}" for r in rows.values()) + " |")
    L += ["", machine]
    return "\n".join(L) + "\n"


def main() -> int:
    start = time.perf_counter()
    rows = measure()
    from .retrieval_ladder import _cpu

    machine = (f"CPU: {_cpu()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; {time.strftime('%Y-%m-%d %H:%M UTC')}; "
               f"{time.perf_counter() - start:.0f} s.")
    save_json(RESULTS / f"{STEM}.json", {"rows": rows, "machine": machine})
    (RESULTS / f"{STEM}.md").write_text(report(rows, machine))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
