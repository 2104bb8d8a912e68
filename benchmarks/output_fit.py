"""The output-aware fit (issue 18) on the built-in SmolLM2-135M: the ablation on dev windows, then the
chosen default on the test windows and on two held-out domains.

    .venv/bin/python -m benchmarks.output_fit             # every setting not yet in the JSON, then the report
    .venv/bin/python -m benchmarks.output_fit --only native/25%/fit-200   # some settings (two processes may share the JSON)
    .venv/bin/python -m benchmarks.output_fit --layer-cost  # the fit's seconds per layer at Qwen2.5-1.5B shapes
    .venv/bin/python -m benchmarks.output_fit --report    # only rewrite the table

Shapes: "export" = the exportable ones (`--shared-rope`: one rope grid and one rank in every layer, what
`--format deepseek` and llama.cpp take; the CLI default since issue 35) and "native" = the unconstrained
shapes (`--per-layer-rope`, each layer its own rope frequencies), at 50/25/12.5% of
the source cache. Settings, each on top of the previous (the ablation):
- method: TransMLA with the CLI defaults (2048 x 16 calibration, original propagation), no fit;
- o_proj: + o_proj fitted in closed form to the source attention's output (output_fit.refit_o_proj);
- fit-N: + N Adam steps per layer on every projection, then o_proj in closed form again (`--fit-steps`;
  the learning rate, sequence shape and propagation were chosen on dev32 at 25% in the exportable shape,
  DEV_CHOICES, with 100 steps, the first default; 200 steps was then better on dev32 at all three
  budgets and is the CLI default); fit-N-bf16: the same with Adam's forward and backward under bf16
  autocast (what the CLI runs where bf16 is native). fit-300-bf16, exportable shapes only, asks
  whether 300 steps should replace 200 (the 50% cli row misses its goal by 0.7%). Rule, written
  before it was measured: it replaces 200 only if its dev32 is more than 1% below fit-200's at every
  budget (below the fp32 fit-200 row, and below fit-200-bf16 where that was measured too), and the
  default 25% conversion then stays under 10 minutes (its fit grows by half: 5.4 min today).
  Outcome: rejected at the first budget measured. At 50% fit-300-bf16 gives dev32 28.52 against
  fit-200's 28.57 (-0.15%), although its attention-output error falls further (0.028 against 0.032);
  the 25% and 12.5% rows were stopped unrun, since the rule needs all three. 200 stays the default.
  (These 50% rows, like every fit-100 / fit-200 row at 50%, have the split of their day, 128 + 64;
  the rows below have today's 160 + 32.)
- fit-200-bf16-n1024 (session of 2026-11-25, 14:55) asks whether the fit should see 1024 sequences
  of 64 tokens instead of 256 (DEFAULT_FIT_CALIBRATION): 200 steps of 32 sequences see each of 256 about
  25 times, and fit-300's lower training error with an unchanged dev32 looked like overfitting to
  them. The 1024 hold the 256 (the same seeded permutation). Rule, written before it was measured: 1024
  replaces 256 only if its dev32 is more than 0.5% below fit-200-bf16's at 50% and at 25% in the
  exportable shape, and the default 25% conversion then stays under 10 minutes.
  Outcome: accepted on dev32. 50%: 27.27 against 27.97 (-2.5%; wiki-dev 22.16 against 22.75, lee-dev
  33.55 against 34.39); 25%: 45.11 against 50.48 (-10.6%; 35.35 against 39.31, 57.56 against 64.82). The
  fit's error on its own sequences rose (0.040 against 0.031 at 50%, 0.127 against 0.104 at 25%): with 256
  it had fitted them, not the layer. transmla.convert.output_fit.DEFAULT_FIT_CALIBRATION was (1024, 64)
  from then until issue 34 moved it to 64 x 1024 (retrieval_ladder); this benchmark keeps its 64-token
  sequences (FIT_SHAPE) so its rows stay comparable; the conversion time is in the cli rows.
- fit-200-n1024 and fit-200-n1024-mb1024 (session of 2026-11-26, 12:40; the fit-cost round of issue 36)
  ask whether Adam's steps should see 1024 tokens (16 sequences) instead of 2048: on a Xeon without AMX
  (AVX-512 BF16 only) a step of 1024 fp32 tokens took 21 s a layer against 33 s for 2048 (44 s under bf16
  autocast, which is why the CLI runs fp32 there now; benchmarks/results/fit_cost.md). Both in fp32, one
  thread, the same CPU and run. Rule, written before it was measured: mb1024 becomes the default only if its
  dev32 at 25% in the exportable shape is at most 0.5% above fit-200-n1024's.
  Outcome: rejected. fit-200-n1024 45.09 (the same as the bf16 row's 45.11: fp32 costs nothing in
  quality), mb1024 46.49 (+3.1%; wiki-dev 36.24 against 35.36, lee-dev 59.63 against 57.49) for 828 s of
  fit against 1509 s (one thread, a Xeon without AMX, the other core busy; the "fit s" column mixes
  machines and threads: the rows before this round ran on a Xeon with AMX, two threads). 2048 tokens a
  step stay the default.
And "cli": `transmla convert` itself with every default (the calibration mix of benchmarks/calib_mix
included: wiki=3,lee=1,code=2 since the session of 2026-11-25 09:20), timed with /usr/bin/time, then the
final windows below. Earlier cli rows are kept under their own names, not rerun: cli@fixed-lr (before
the fit's lr backoff), cli@wiki3-code1 (the wiki=3,code=1 mix, with the backoff), at 50% only
cli@third-rope (128 + 64: a third of the budget as rope dims, before the cap at half a head), and
cli@fit-256 (the fit on 256 sequences, before 1024).
The fit runs through calibrate.calibrated_layers as `transmla convert` does, on 256 x 64 tokens of the
wiki calibration part drawn with seed 1 from everything before the dev windows (the CLI draws from the
whole part; here the dev windows are never fitted on).
Dev: dev32 (16 wiki + 16 lee windows of 512, smollm2.Bench; pooled perplexity chooses; not for the cli
rows, whose calibration may sample the dev windows). Final, for the defaults only (fit-100, fit-200, cli):
wiki-test 32 and 64 windows, lee-test (29), and 16 windows of Python stdlib modules n..z and of Debian's
licence texts (calib_mix.held_out_texts; the cli rows calibrate on modules a..m of the same library).

Writes benchmarks/results/output_fit.json (resumable) and output_fit.md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from transmla.convert.calibrate import calibrated_layers
from transmla.convert.output_fit import FitSettings, fit_layer
from transmla.convert.transmla.method import DEFAULT_FIT_STEPS, shared_rope_plan
from transmla.data.texts import load_text
from transmla.dtypes import fast_bf16_matmul
from transmla.eval.perplexity import perplexity, tokenize_text

from .calib_mix import held_out_texts
from .common import RESULTS, TRANSMLA, ResultCache, log, machine, timed
from .smollm2 import CACHE, DEV_WINDOWS, MODEL, SEQ, Bench, cli_defaults, ours_plan

OUT_JSON = RESULTS / "output_fit.json"
OUT_MD = RESULTS / "output_fit.md"
BUDGETS = ("50%", "25%", "12.5%")
SHAPES = ("export", "native")
DEFAULT = f"fit-{DEFAULT_FIT_STEPS}"
HELD_OUT_WINDOWS = 16
FIT_SHAPE = (1024, 64)  # the fit's sequences here: the CLI's until issue 34 (module notes)


# How the fit itself was set, on dev32 at 25% in the exportable shape (method alone: 114.29), by an
# exploratory script of the same algorithm before it moved into output_fit.py (not kept): the
# choices are the rows marked "chosen". (setting, dev32 pooled, wiki-dev, lee-dev)
DEV_CHOICES = [
    ("o_proj closed form only, 256 x 64 fit tokens", 68.51, 53.53, 87.69),
    ("+ 100 Adam steps, lr 1e-3, inputs from the original layers", 53.70, 41.74, 69.09),
    ("+ 100 Adam steps, lr 1e-3, inputs from the converted layers", 55.44, 44.10, 69.68),
    ("+ 100 Adam steps, lr 3e-3, o_proj closed form again after Adam (chosen)", 53.24, 41.49, 68.31),
    ("the same on 64 x 256 fit tokens instead of 256 x 64", 54.41, 44.87, 65.97),
    # measured later by this script (JSON row export/25%/fit-200-cos), against fit-200's 50.69 / 39.53 / 65.00:
    ("200 Adam steps with the learning rate decayed to 0 by a half cosine (not kept)", 53.04, 41.57, 67.68),
]


def settings() -> list[tuple[str, str, str]]:
    """(shape, budget, setting) in the order they run: the exportable ablation at every budget first
    (the goals are stated for those shapes), then the native defaults. fit-100 was the first default;
    fit-200 won on dev32 at every budget in the exportable shape and replaced it; fit-200-bf16 (Adam's
    passes under bf16 autocast, FitSettings.bf16: AMX makes them cheaper here) tied it on dev32 and is
    what the CLI runs where bf16 is native (the cli rows)."""
    out = []
    for budget in BUDGETS:
        out += [("export", budget, s) for s in ("method", "o_proj", "fit-100", "fit-200", "fit-200-bf16")]
    out.append(("export", "50%", "fit-300-bf16"))  # rejected at 50%, the other budgets left unrun (docstring)
    out += [("export", "50%", "fit-200-bf16-n1024"), ("export", "25%", "fit-200-bf16-n1024")]  # fit-sequences round
    out += [("export", "25%", "fit-200-n1024"), ("export", "25%", "fit-200-n1024-mb1024")]  # fit-cost round
    for budget in ("25%", "50%", "12.5%"):
        out += [("native", budget, s) for s in ("method", "fit-100", "fit-200")]
    # earlier cli rows (KEPT_CLI: before the fit's lr backoff, before the lee mix, before the rope cap), kept, not rerun
    return out + [(shape, budget, cli) for cli in (*KEPT_CLI, "cli") for shape in SHAPES for budget in BUDGETS]


KV_BUDGET = {"50%": "0.5", "25%": "0.25", "12.5%": "0.125"}
KEPT_CLI = ("cli@fixed-lr", "cli@wiki3-code1", "cli@third-rope", "cli@fit-256")


def cli_model(shape: str, budget: str):
    """`transmla convert` with its defaults (calibration mix, fit and all) as a user runs it, loaded
    back; and the conversion's wall seconds and peak RSS (GiB) measured around the process."""
    from transformers import AutoModelForCausalLM

    import transmla  # noqa: F401  (registers the MLA models)

    out = CACHE / f"output-fit-cli-{shape}-{budget.rstrip('%')}"
    cmd = [str(TRANSMLA), "convert", MODEL, str(out), "--method", "transmla", "--kv-budget", KV_BUDGET[budget], "--force"]
    cmd += ["--shared-rope"] if shape == "export" else ["--per-layer-rope"]
    cost = timed(cmd, out.with_name(out.name + ".log"))
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    return model, cost


def fit_of(setting: str) -> FitSettings | None:
    if setting == "method":
        return None
    if setting == "o_proj":
        return FitSettings(steps=0)
    steps, *variants = setting.removeprefix("fit-").split("-")
    minibatch = [int(v[2:]) for v in variants if v[:2] == "mb" and v[2:].isdigit()]
    return FitSettings(steps=int(steps), bf16="bf16" in variants, **({"minibatch_tokens": minibatch[0]} if minibatch else {}))


def fit_samples(setting: str) -> int:
    """The fit's sequences: FIT_SHAPE's count, or N for a setting with the variant nN."""
    counts = [int(v[1:]) for v in setting.split("-")[1:] if v[:1] == "n" and v[1:].isdigit()]
    return counts[0] if counts else FIT_SHAPE[0]


def fit_ids(b: Bench, n: int = FIT_SHAPE[0]) -> torch.Tensor:
    """n (default 1024) x 64 tokens of the wiki calibration part before the dev windows, seed 1."""
    t = FIT_SHAPE[1]
    ids = tokenize_text(b.tok, load_text("wiki", "calib"))[: -DEV_WINDOWS * SEQ]
    chunks = ids[: ids.numel() // t * t].view(-1, t)
    pick = torch.randperm(chunks.shape[0], generator=torch.Generator().manual_seed(1))[:n].sort().values
    return chunks[pick].clone()


def method_layers(b: Bench, shape: str, budget: str):
    calib, propagate = cli_defaults()
    assert propagate == "original"
    plan = ours_plan(budget)
    if shape == "export":
        plan = shared_rope_plan(plan, b.config.head_dim)
    return b.layers_original(plan, b.original_stats(*calib))[0]


def fitted_layers(b: Bench, layers, fit: FitSettings, samples: int = FIT_SHAPE[0]) -> tuple[list, list[dict]]:
    """`layers` fitted layer by layer as `transmla convert` does (calibrated_layers with a fit_layer) on
    `samples` fit sequences, original propagation; the statistics stream is one sequence (unused: the
    layers are given)."""
    ids = fit_ids(b, samples)
    infos: list[dict] = []

    def fit_one(i, layer, x, z, attend):
        fitted, info = fit_layer(b.config, layer, x, z, fit, i, attend)
        infos.append(info)
        return fitted

    out = list(calibrated_layers(b.src_dir, b.config, ids[:1], lambda i, src, stats: layers[i],
                                 fit_ids=ids, fit_layer=fit_one, progress=False))
    return out, infos


def build(b: Bench, shape: str, budget: str, setting: str):
    layers = method_layers(b, shape, budget)
    fit = fit_of(setting)
    if fit is None:
        return layers, {}
    start = time.perf_counter()
    layers, infos = fitted_layers(b, layers, fit, fit_samples(setting))
    errors = [i["output_error"] for i in infos]
    return layers, {
        "fit_seconds": time.perf_counter() - start,
        "mean_output_error": [sum(e[k] for e in errors) / len(errors) for k in (0, 1)],
    }


def held_out(b: Bench, model) -> dict:
    out = {}
    for name in ("code", "licences"):
        ids = tokenize_text(b.tok, held_out_texts()[name].read_text(encoding="utf-8"))
        out[name] = perplexity(model, ids, SEQ, max_windows=HELD_OUT_WINDOWS, progress=False).perplexity
    return out


def run(b: Bench, cache: ResultCache, only: set[str] | None = None) -> None:
    torch.manual_seed(0)
    if "source" not in cache.results:
        model = b.source_model()
        cache.results["source"] = {"dev32": b.dev32_ppl(model), "final": b.final_ppl(model), "held_out": held_out(b, model)}
        cache.save()
    for shape, budget, setting in settings():
        key = f"{shape}/{budget}/{setting}"
        if only is not None and key not in only:
            continue
        final = setting in ("fit-100", "fit-200", "cli") or (setting == "method" and shape == "export" and budget == "25%")
        row = cache.results.get(key, {})
        if setting in KEPT_CLI:
            continue
        if ("dev32" in row or setting == "cli") and (not final or "final" in row):
            continue
        log(f"{key}")
        if setting == "cli":  # the CLI samples its calibration from the whole part: no clean dev32
            model, info = cli_model(shape, budget)
            row = {**row, **info}
        else:
            layers, info = build(b, shape, budget, setting)
            model = b.model(layers)
            row = {**row, **info, "dev32": b.dev32_ppl(model)}
        if final:
            row |= {"final": b.final_ppl(model), "held_out": held_out(b, model)}
        cache.results[key] = row
        cache.save()
        msg = f"{key}: dev32 {row['dev32']['ppl']:.2f}" if "dev32" in row else key
        log(msg + (f", wiki-test-32 {row['final']['wiki_test_32']:.2f}" if final else ""))


# Qwen2.5-1.5B's attention shapes (the real model: benchmarks/qwen2_1p5b.py), on one random layer.
QWEN2_1P5B_LAYER = dict(hidden_size=1536, num_attention_heads=12, num_key_value_heads=2, head_dim=128,
                        attention_bias=True, rope_theta=1e6, max_position_embeddings=32768)
QWEN2_1P5B_LAYERS = 28


def layer_cost(steps: int = DEFAULT_FIT_STEPS, bf16: bool = False) -> dict:
    """Seconds to convert one random layer of Qwen2.5-1.5B's attention shapes at 25% (2048 x 16
    calibration tokens, as the CLI) without and with the fit (256 x 64 tokens): the fit's cost at a
    size where the full conversion (qwen2_1p5b) takes 12-21 min without it. Random weights and ids:
    the cost does not depend on the values."""
    import tempfile

    from transformers import AutoConfig, Qwen2Config, Qwen2ForCausalLM

    from transmla.convert.options import ConvertOptions
    from transmla.convert.pipeline import LayerStream
    from transmla.convert.registry import get_method

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        Qwen2ForCausalLM(Qwen2Config(vocab_size=1000, intermediate_size=256, num_hidden_layers=1,
                                     **QWEN2_1P5B_LAYER)).save_pretrained(tmp)
        config = AutoConfig.from_pretrained(tmp)
        calib = torch.randint(0, 1000, (2048, 16), generator=torch.Generator().manual_seed(1))
        fit_ids = torch.randint(0, 1000, FIT_SHAPE, generator=torch.Generator().manual_seed(2))
        out = {"threads": torch.get_num_threads(), "steps": steps, "bf16": bf16}
        for name, fit in (("convert_seconds", FitSettings(steps=0)),
                          ("convert_and_fit_seconds", FitSettings(steps=steps, bf16=bf16))):
            options = ConvertOptions.of(method="transmla", device="cpu", kv_budget=0.25, shared_rope=False)
            start = time.perf_counter()
            list(LayerStream(get_method("transmla"), Path(tmp), config, options, progress=False, calib_ids=calib,
                             fit_ids=fit_ids, fit=fit))
            out[name] = time.perf_counter() - start
            log(f"one Qwen2.5-1.5B-shaped layer, {name}: {out[name]:.1f} s")
    return out


def _x(value: float, source: float) -> str:
    return f"{value:.2f} ({value / source:.2f}x)"


def report(results: dict) -> str:
    src = results["source"]
    lines = [
        "# Output-aware fit on SmolLM2-135M (issue 18; training-free, fp32)",
        "",
        f"Machine: {results.get('machine', '?')}. Re-run: `python -m benchmarks.output_fit` (see its docstring).",
        "",
        f"## Ablation on dev32 (16 wiki + 16 lee windows of 512; pooled perplexity; source {src['dev32']['ppl']:.2f})",
        "",
        "| shape | cache | setting | dev32 | wiki-dev | lee-dev | attention-output error (fit tokens) before -> after | fit s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for shape, budget, setting in settings():
        row = results.get(f"{shape}/{budget}/{setting}")
        if not row or "dev32" not in row:
            continue
        d = row["dev32"]
        err = row.get("mean_output_error")
        err_s = f"{err[0]:.3f} -> {err[1]:.3f}" if err else "-"
        secs = f"{row['fit_seconds']:.0f}" if "fit_seconds" in row else "-"
        lines.append(f"| {shape} | {budget} | {setting} | {_x(d['ppl'], src['dev32']['ppl'])} | {d['wiki']:.2f} | "
                     f"{d['lee']:.2f} | {err_s} | {secs} |")
    lines += [
        "",
        "How the fit was set (dev32, 25%, exportable shape; an exploratory script of the same algorithm, "
        "method alone 114.29):",
        "",
        "| setting | dev32 | wiki-dev | lee-dev |",
        "|---|---|---|---|",
        *[f"| {name} | {p:.2f} | {w:.2f} | {l:.2f} |" for name, p, w, l in DEV_CHOICES],
    ]
    lines += [
        "",
        f"## Test windows and held-out domains ({DEFAULT} is the default fit on wiki, fit-100 the first one; "
        "cli = `transmla convert` with all its defaults, the calibration mix included, timed around the "
        "process with its load; source in the first row)",
        "",
        "| shape | cache | setting | wiki-test 32 | wiki-test 64 | lee-test | code (16) | licences (16) | conversion: min, peak GiB, load |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| source | 100% | - | {src['final']['wiki_test_32']:.2f} | {src['final']['wiki_test_64']:.2f} | "
        f"{src['final']['lee_test']:.2f} | {src['held_out']['code']:.2f} | {src['held_out']['licences']:.2f} | - |",
    ]
    for shape, budget, setting in settings():
        row = results.get(f"{shape}/{budget}/{setting}")
        if not row or "final" not in row:
            continue
        f, h, s = row["final"], row["held_out"], src["final"]
        lines.append(
            f"| {shape} | {budget} | {setting} | {_x(f['wiki_test_32'], s['wiki_test_32'])} | "
            f"{_x(f['wiki_test_64'], s['wiki_test_64'])} | {_x(f['lee_test'], s['lee_test'])} | "
            f"{_x(h['code'], src['held_out']['code'])} | {_x(h['licences'], src['held_out']['licences'])} | "
            + (f"{row['wall_s'] / 60:.1f}, {row['peak_rss_gib']:.2f}, {row['load_before'][0]:.1f} |" if "wall_s" in row else "- |")
        )
    for key in ("qwen2_1p5b_layer_cost", "qwen2_1p5b_layer_cost_bf16"):
        cost = results.get(key)
        if not cost:
            continue
        added = cost["convert_and_fit_seconds"] - cost["convert_seconds"]
        lines += [
            "",
            f"## The fit's cost at Qwen2.5-1.5B's shapes (`--layer-cost`; one random layer at 25%, "
            f"{cost['threads']} thread(s), load {cost['machine']['load_average']}, Adam in "
            f"{'bf16 autocast (the CLI here)' if cost.get('bf16') else 'fp32'})",
            "",
            f"Converting the layer: {cost['convert_seconds']:.0f} s; with the fit ({cost['steps']} steps): "
            f"{cost['convert_and_fit_seconds']:.0f} s, so the fit adds {added:.0f} s a layer, "
            f"{added * QWEN2_1P5B_LAYERS / 60:.0f} min for the model's {QWEN2_1P5B_LAYERS} layers.",
        ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", action="store_true", help="only rewrite the table")
    parser.add_argument("--layer-cost", action="store_true", help="only time the fit on one Qwen2.5-1.5B-shaped layer")
    parser.add_argument("--only", help="comma-separated settings to run, e.g. native/25%%/fit-200 (default: all)")
    args = parser.parse_args(argv)
    cache = ResultCache(OUT_JSON)
    if args.layer_cost:
        bf16 = fast_bf16_matmul("cpu")  # as the CLI fits
        key = "qwen2_1p5b_layer_cost" + ("_bf16" if bf16 else "")
        cache.results[key] = {**layer_cost(bf16=bf16), "machine": machine()}
        cache.save()
    elif not args.report:
        cache.results["machine"] = machine()
        run(Bench(), cache, set(args.only.split(",")) if args.only else None)
    OUT_MD.write_text(report(cache.results))
    print(OUT_MD.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
