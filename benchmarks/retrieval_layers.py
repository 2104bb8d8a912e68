"""Which layers' RoRoPE/FreqFold step loses retrieval (issue 34), on the built-in SmolLM2-135M.

    .venv/bin/python -m benchmarks.retrieval_layers                 # every group not yet measured
    .venv/bin/python -m benchmarks.retrieval_layers --report        # only rewrite the table

The retrieval ladder (benchmarks/retrieval_ladder) found the exportable 50% conversion loses the
passkey at its RoRoPE/FreqFold step. Here only some layers take that step (their "rorope" stage: the
kept rope components rotate, the others lose RoPE, the latent at full rank) and every other layer is
the source's attention exactly (replicated into MLA form, lossless). Measure: the key probe of the
ladder (dev keys, seed 1) at 2K only (15 prompts: 5 keys x depths 10/50/90), key NLL / exact.
A group whose conversion alone costs most of the loss is where retrieval lives; the variant of the
method that fixes it must keep it there.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from .common import ResultCache, log

OUT = Path(__file__).resolve().parent / "results"
STEM = "retrieval_layers"
DEV_PASSKEY = dict(depths="10,50,90", keys=5, seed=1)
LENGTHS = [2048]
NUM_LAYERS = 30
GROUPS = {f"{a}-{a + 4}": list(range(a, a + 5)) for a in range(0, NUM_LAYERS, 5)}
VARIANTS = {  # name -> (options beside the exportable 50% conversion, what the rorope stage keeps)
    "cli-50": ({}, "latent 160 + rope 32 (F = 2)"),
    "rope-64": ({"kv_budget": None, "kv_lora_rank": 128, "rope_dim": 64}, "latent 128 + rope 64 (F = 1)"),
}


def measure(variant: str, name: str, layers_set: list[int], cache: ResultCache) -> None:
    import torch

    from transmla.convert.calibrate import mla_attention
    from transmla.convert.options import ConvertOptions
    from transmla.convert.pipeline import LayerStream
    from transmla.convert.registry import get_method
    from transmla.convert.replicate import replicate
    from transmla.eval.key_probe import key_probe
    from transmla.eval.passkey import PasskeySettings

    from .retrieval_ladder import cached_stats
    from .smollm2 import Bench

    b = Bench()
    kw = {"method": "transmla", "kv_budget": 0.5, "shared_rope": True, "fit_steps": 0} | VARIANTS[variant][0]
    options = ConvertOptions.of(**{k: v for k, v in kw.items() if v is not None})
    method = get_method("transmla")
    stream = LayerStream(method, b.src_dir, b.config, options, progress=False)
    stats = cached_stats(b, stream)
    start = time.perf_counter()
    layers = [method.stage_layers(stream.plan, src, st)["rorope"] for src, st in zip(b.sources, stats)]
    model = b.model(layers)
    model.config.use_cache = False  # layers of two shapes: one forward without a cache
    for i, src in enumerate(b.sources):
        if i not in layers_set:  # the source's attention exactly, in MLA form, in place of the converted one
            model.model.layers[i].self_attn = mla_attention(b.config, replicate(src), "cpu")
    with torch.no_grad():
        probe = key_probe(model, b.tok, PasskeySettings(**DEV_PASSKEY), LENGTHS)
    cache.results[f"{variant}/{name}"] = dict(variant=variant, group=name, layers=layers_set, nll=probe["nll"],
                                             exact=probe["exact"], keys=probe["keys"], cells=probe["cells"],
                                             seconds=time.perf_counter() - start, load=os.getloadavg()[0])
    cache.save()


def report(results: dict) -> str:
    L = ["# Which layers' RoRoPE step loses retrieval (issue 34)", "",
         (__doc__ or "").split("\n\n", 2)[2].strip(), "",
         "key NLL / exact of 15 (2K, dev keys) with only these layers converted (rorope stage):", "",
         "| layers converted | " + " | ".join(f"{v}: {d}" for v, (_, d) in VARIANTS.items()) + " |",
         "|---|" + "---|" * len(VARIANTS)]
    for name in ["none", *GROUPS, "all"]:
        cells = []
        for v in VARIANTS:
            r = results.get(f"{v}/{name}")
            cells.append(f"{r['nll']:.3f} / {r['exact']}" if r else "-")
        L.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--groups", default=None, help="comma-separated: none, all, or groups like 0-4")
    ap.add_argument("--report", action="store_true")
    args = ap.parse_args(argv)
    cache = ResultCache(OUT / f"{STEM}.json")
    sets = {"none": [], **GROUPS, "all": list(range(NUM_LAYERS))}
    if not args.report:
        for v in args.variants.split(","):
            for name in (args.groups.split(",") if args.groups else sets):
                if f"{v}/{name}" in cache.results:
                    continue
                log(f"{v}: layers {name}")
                measure(v, name, sets[name], cache)
                (OUT / f"{STEM}.md").write_text(report(cache.results))
    (OUT / f"{STEM}.md").write_text(report(cache.results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
