"""TransMLA on the built-in SmolLM2-135M: the published algorithm against our choices.

    .venv/bin/python -m benchmarks.transmla_bench               # every phase (resumes from its cache)
    .venv/bin/python -m benchmarks.transmla_bench --phase dev32 [--only NAME]   # one dev32 candidate

Training-free perplexity at 50 / 25 / 12.5% of the source KV cache (R + r = 128+64, 64+32,
32+16), 512-token non-overlapping windows, fp32, on this machine's CPU:
- final: wiki-test (the first 64 windows of the built-in wiki evaluation part; the first 32 also
  reported, the ANCHORS.md protocol) and lee-test (all of its 29 windows: it has no more);
- dev32: open decisions are chosen on 16 windows from the END of the wiki calibration part and
  the first 16 of the lee calibration part (never on the test parts; lee is never calibrated on).
  Wiki calibration chunks are drawn at random from the same part, so a wiki dev window may
  overlap a calibration chunk.
- dev (history): the first round of decisions, on 8 wiki windows only; the test set showed that
  this was too few (see the report), which is why dev32 exists.
Published = TransMLA as the public code runs it: 128 x 256 calibration tokens (seed 42),
RoRoPE calibrated on the original model, BKV-PCA calibrated on the partial-RoPE model, the
same number of rope components in every fold group, the frequency rule w_(aF), w_(aF+c), ...,
plain NoPE, uncentred PCA, freqfold 2 / 4 / 4 (the settings of the public numbers in ANCHORS.md).
Ours = the defaults of `transmla convert --method transmla` (transmla.convert.transmla.method's
default_plan, and the method's default_calibration and default_propagate as CalibrationOptions
resolves them), chosen on dev32. Every conversion goes through the method (registry.get_method,
ConversionMethod.convert_layer, pipeline.LayerStream; benchmarks/smollm2.py) except the published
two-stage path, which the method deliberately does not offer (Bench.layers_published).

Writes benchmarks/results/transmla_bench.json, transmla_bench.md and transmla_ppl_vs_cache.png.
Intermediate results are cached under $TRANSMLA_CACHE/bench-transmla (statistics and every
perplexity), so an interrupted run resumes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import replace

import torch

import transmla  # noqa: F401
from transmla.convert.transmla.method import TransMLAPlan, published_plan
from transmla.eval.perplexity import perplexity
from transmla.families import attention_geometry

from .common import RESULTS, machine
from .smollm2 import (
    BUDGETS,
    CACHE,
    DEV_WINDOWS,
    MODEL,
    PUBLISHED_CALIB,
    SEQ,
    Bench,
    cli_defaults,
    ours_layers,
    ours_plan,
    summarize_infos,
)

ANCHOR_PUBLIC = {"source": 18.15, "50%": 33.18, "25%": 83.60, "12.5%": 258.71}  # ANCHORS.md, 32 windows


# ---------------------------------------------------------------------------------------------
# Phases
# ---------------------------------------------------------------------------------------------


def dev_plans(budget: str) -> dict[str, TransMLAPlan]:
    """The open decisions measured on the dev windows, in order (each on the published 128 x 256
    original-propagation statistics, so that only the named choice changes)."""
    R, r, fold = BUDGETS[budget]
    pub = published_plan(R, r, fold)
    plans = {"published-original-only": pub}
    for f in (1, 2, 4, 8):  # every other fold the published (uniform) selection allows
        if f != fold and (r // 2) % (32 // f) == 0:
            plans[f"uniform-F{f}"] = replace(pub, freqfold=f)
    plans["score-F1"] = replace(pub, freqfold=1, selection="score")
    plans["score-F1-nopescale"] = replace(pub, freqfold=1, selection="score", nope_scale=True)
    plans["uniform-logit"] = replace(pub, freqfold="logit")  # per layer, least expected logit error
    plans["score-F2"] = replace(pub, freqfold=2, selection="score")
    plans["score-F4"] = replace(pub, freqfold=4, selection="score")
    plans["score-logit"] = replace(pub, freqfold="logit", selection="score")
    return plans


def phase_dev(b: Bench) -> None:
    """Open decisions, each measured on the dev windows (8 x 512 tokens of the wiki calibration part)."""
    n, t, seed = PUBLISHED_CALIB
    pub_stats = b.original_stats(n, t, seed)
    b.cached("dev/source", lambda: {"ppl": b.dev_ppl(b.source_model())})
    order = [(budget, name, plan) for budget in BUDGETS for name, plan in dev_plans(budget).items()]
    order.sort(key=lambda x: list(dev_plans(x[0])).index(x[1]))  # every budget for one choice, then the next
    for budget, name, plan in order:
        b.cached(f"dev/{budget}/{name}", lambda: dev_entry(b, *b.layers_original(plan, pub_stats)))


def dev_entry(b: Bench, layers, infos) -> dict:
    return {"ppl": b.dev_ppl(b.model(layers)), **summarize_infos(infos)}


# ---------------------------------------------------------------------------------------------
# Propagation and calibration size (on top of the best plan), then the final table
# ---------------------------------------------------------------------------------------------


# Candidates on the dev32 windows at every budget: (calibration, propagation, plan overrides).
DEV32_CANDIDATES = {
    "activation-128x256-original": ((128, 256, 42), "original", {"pca_metric": "activation"}),
    "attention-128x256-original": ((128, 256, 42), "original", {"pca_metric": "attention"}),
    "activation-centre-128x256-original": ((128, 256, 42), "original", {"pca_metric": "activation", "centre": True}),
    "attention-centre-128x256-original": ((128, 256, 42), "original", {"pca_metric": "attention", "centre": True}),
    "output-128x256-original": ((128, 256, 42), "original", {"pca_metric": "output"}),
    "activation-64x512-original": ((64, 512, 0), "original", {"pca_metric": "activation"}),
    "output-64x512-original": ((64, 512, 0), "original", {"pca_metric": "output"}),
    "output-128x256s0-original": ((128, 256, 0), "original", {"pca_metric": "output"}),
    "output-256x128s0-original": ((256, 128, 0), "original", {"pca_metric": "output"}),
    "activation-128x256s0-original": ((128, 256, 0), "original", {"pca_metric": "activation"}),
    "output-512x64s0-original": ((512, 64, 0), "original", {"pca_metric": "output"}),
    "output-1024x32s0-original": ((1024, 32, 0), "original", {"pca_metric": "output"}),
    "activation-512x64s0-original": ((512, 64, 0), "original", {"pca_metric": "activation"}),
    "output-2048x16s0-original": ((2048, 16, 0), "original", {"pca_metric": "output"}),
    "activation-2048x16s0-original": ((2048, 16, 0), "original", {"pca_metric": "activation"}),
    "output-4096x8s0-original": ((4096, 8, 0), "original", {"pca_metric": "output"}),
    "output-1024x32s0-converted": ((1024, 32, 0), "converted", {"pca_metric": "output"}),
    "activation-64x512-converted": ((64, 512, 0), "converted", {"pca_metric": "activation"}),
    "attention-64x512-converted": ((64, 512, 0), "converted", {"pca_metric": "attention"}),
}


DEV32_DECISIONS = (
    "What the table decided, reading pooled perplexity at every budget: (1) at an equal 32,768 calibration tokens, "
    "more and shorter sequences are better at every budget from 64 x 512 down to 1024 x 32; 2048 x 16 is the best "
    "over the three budgets (the sum of log perplexities; 1024 x 32 is 1% better at 50%), 4096 x 8 is worse at "
    "50% and 25%, so 2048 x 16 is the default (the seed changes less: 128 x 256 with seed 0 or 42). Our reading: every evaluation window, like every prompt, "
    "starts with an attention-sink token whose key and value most heads attend to; a calibration sequence "
    "contributes one such token, so short sequences weight it properly. (2) With 64 to 512 sequences the output-weighted "
    "PCA beats the plain PCA at 50% (by 1.5-12%) but not at 12.5%; at 2048 x 16 the plain PCA is better at every "
    "budget (32.0 / 83.5 / 253.9 against 32.3 / 85.7 / 256.8), so the default keeps the published plain PCA. "
    "Weighting the keys by the queries too (attention) or centring helps at 50% and hurts badly below. (3) Calibrating later layers on the original model's outputs beats "
    "calibrating them on the converted layers' outputs at every budget (1024 x 32: 31.9 / 89.1 / 278.9 against "
    "32.1 / 91.1 / 290.1); the converted propagation fits wiki (the calibration text) at lee's expense."
)


def phase_dev32(b: Bench, only: str | None = None) -> None:
    """The published algorithm and our candidates on the dev32 windows (16 wiki + 16 lee)."""
    n, t, seed = PUBLISHED_CALIB
    b.cached("dev32/source", lambda: b.dev32_ppl(b.source_model()))
    for budget, (R, r, fold) in BUDGETS.items():
        pub = published_plan(R, r, fold)
        if only in (None, "published"):
            b.cached(f"dev32/{budget}/published", lambda: b.dev32_ppl(b.model(
                b.layers_published(pub, b.published_pca_grams(budget), b.original_grams(n, t, seed))[0])))
        for name, (calib, propagate, overrides) in DEV32_CANDIDATES.items():
            if only is None or only == name:
                b.cached(f"dev32/{budget}/{name}", lambda: {
                    **b.dev32_ppl(b.model(ours_layers(b, budget, calib, propagate, **overrides)[0])),
                    "calibration": list(calib), "propagation": propagate, **overrides})


def phase_final(b: Bench, only: str | None = None) -> None:
    """Test perplexities: the published algorithm and ours = the CLI defaults (chosen on dev32)."""
    n, t, seed = PUBLISHED_CALIB
    calib, propagate = cli_defaults()
    b.cached("final/source", lambda: b.final_ppl(b.source_model()))
    for budget, (R, r, fold) in BUDGETS.items():
        if only is not None and budget != only:
            continue
        pub = published_plan(R, r, fold)
        b.cached(f"final/{budget}/published", lambda: {
            **b.final_ppl(b.model(b.layers_published(pub, b.published_pca_grams(budget), b.original_grams(n, t, seed))[0])),
            "plan": pub.to_dict(), "calibration": list(PUBLISHED_CALIB), "propagation": "original (RoRoPE) + partial-RoPE (PCA)"})
        b.cached(f"final/{budget}/ours", lambda: {
            **b.final_ppl(b.model(ours_layers(b, budget, calib, propagate)[0])),
            **summarize_infos(ours_layers(b, budget, calib, propagate)[1]),
            "plan": ours_plan(budget).to_dict(), "calibration": list(calib), "propagation": propagate})


def phase_lee64(b: Bench, only: str | None = None) -> None:
    """Perplexity on 64 held-out lee windows (Bench.lee64_ids) of the source, published and ours."""
    n, t, seed = PUBLISHED_CALIB
    calib, propagate = cli_defaults()
    lee64 = lambda model: {"ppl": perplexity(model, b.lee64_ids, SEQ, progress=False).perplexity}  # noqa: E731
    if only in (None, "source"):
        b.cached("lee64/source", lambda: lee64(b.source_model()))
    for budget, (R, r, fold) in BUDGETS.items():
        if only not in (None, budget):
            continue
        pub = published_plan(R, r, fold)
        b.cached(f"lee64/{budget}/published", lambda: lee64(b.model(
            b.layers_published(pub, b.published_pca_grams(budget), b.original_grams(n, t, seed))[0])))
        b.cached(f"lee64/{budget}/ours", lambda: lee64(b.model(ours_layers(b, budget, calib, propagate)[0])))


def phase_time(b: Bench) -> None:
    """One end-to-end CLI conversion (ours, 25%) under /usr/bin/time -v, and the public code's
    way of calibrating (every layer's q/k/v activations kept) for comparison."""
    calib, propagate = cli_defaults()

    def run() -> dict:
        out = CACHE / "cli-out"
        cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "transmla.cli.app", "convert", MODEL, str(out),
               "--method", "transmla", "--kv-budget", "0.25", "--per-layer-rope", "--calib", "wiki",
               "--device", "cpu", "--force"]  # every other setting: the CLI defaults (native shape: per-layer rope)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(proc.stderr[-2000:])
        fields = {}
        for line in proc.stderr.splitlines():
            line = line.strip()
            if line.startswith("Elapsed (wall clock) time"):
                clock = line.rsplit(" ", 1)[-1].split(":")
                fields["wall_s"] = sum(float(x) * 60**i for i, x in enumerate(reversed(clock)))
            elif line.startswith("Maximum resident set size"):
                fields["peak_rss_mb"] = int(line.rsplit(" ", 1)[-1]) / 1024
            elif line.startswith(("User time", "System time")):
                fields[line.split(" ")[0].lower() + "_s"] = float(line.rsplit(" ", 1)[-1])
        fields["command"] = " ".join(cmd[3:]).replace(sys.executable, "python")
        return fields

    b.cached("time/cli-25%", run)
    geo = attention_geometry(b.config)
    tokens = calib[0] * calib[1]
    per_token_layer = geo.num_heads * geo.head_dim + 2 * geo.num_kv_heads * geo.head_dim  # q, k, v outputs
    b.results["time/activations"] = {
        "tokens": tokens,
        "all_layers_qkv_fp32_gb": tokens * geo.num_layers * per_token_layer * 4 / 1e9,
        "hidden_states_fp32_mb": tokens * geo.hidden_size * 4 / 1e6,
        "one_layer_gram_mb": (geo.hidden_size + 1) ** 2 * 8 / 1e6,
    }
    b.save()


def report(b: Bench) -> None:
    r = b.results
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"machine": machine(), "model": MODEL, "budgets": {k: {"kv_lora_rank": v[0], "rope_dim": v[1]} for k, v in BUDGETS.items()},
           "public_transmla_anchor_wiki_test_32": ANCHOR_PUBLIC, "results": r}
    (RESULTS / "transmla_bench.json").write_text(json.dumps(out, indent=1, sort_keys=True))
    src = r.get("final/source", {})
    lines = [
        "# TransMLA on SmolLM2-135M: published vs ours (training-free)",
        "",
        f"Machine: {out['machine']['machine']}, {out['machine']['threads']} thread(s), torch {out['machine']['torch']}, "
        f"transformers {out['machine']['transformers']}, fp32. Re-run: `python -m benchmarks.transmla_bench`.",
        "Perplexity: token-level exp(mean NLL) over non-overlapping 512-token windows; wiki-test = the first 64 "
        "windows of the built-in wiki evaluation part (32 = the ANCHORS.md protocol); lee-test = all 29 windows of "
        "the lee evaluation part (it has no more); lee-64 = 64 more lee windows, the ones after the dev windows in "
        "the lee calibration part (no lee text is ever calibrated on; these were not looked at while choosing).",
        "",
        "| cache (R + r) | model | wiki-test 64 | wiki-test 32 | lee-test 29 | lee-64 | public TransMLA, wiki-test 32 (ANCHORS) |",
        "|---|---|---|---|---|---|---|",
    ]
    fmt = lambda x: "–" if x is None else f"{x:.2f}"  # noqa: E731
    keys = ("wiki_test_64", "wiki_test_32", "lee_test", "lee_64")

    def row(label: str, e: dict, lee64_key: str, anchor="") -> str:
        e = {**e, "lee_64": r.get(lee64_key, {}).get("ppl")}
        return f"| {label} | " + " | ".join(fmt(e.get(k)) for k in keys) + f" | {anchor} |"

    if src:
        lines.append(row("384 (100%) | source", src, "lee64/source", ANCHOR_PUBLIC["source"]))
    gains = []
    for budget, (R, rd, fold) in BUDGETS.items():
        pub, ours = r.get(f"final/{budget}/published"), r.get(f"final/{budget}/ours")
        if pub:
            lines.append(row(f"{R}+{rd} ({budget}) | published (ours reproduced), F={fold}", pub, f"lee64/{budget}/published",
                             ANCHOR_PUBLIC[budget]))
        if ours:
            lines.append(row(f"{R}+{rd} ({budget}) | **ours (CLI defaults)**", ours, f"lee64/{budget}/ours"))
        sup = r.get(f"superseded/final/{budget}/ours")
        if sup:
            lines.append(row(f"{R}+{rd} ({budget}) | ours with the output-weighted PCA (run before dev32 chose the plain PCA)",
                             sup, f"superseded/lee64/{budget}/ours"))
        prev = r.get(f"final/{budget}/previous-defaults")
        if prev:
            lines.append(row(f"{R}+{rd} ({budget}) | our previous defaults ({prev['calibration'][0]}x{prev['calibration'][1]}, "
                             f"{prev['propagation']} propagation, activation PCA)", prev, "-"))
        if pub and ours:
            g = {k: 1 - ours[k] / pub[k] for k in keys[:3]}
            lp, lo = r.get(f"lee64/{budget}/published"), r.get(f"lee64/{budget}/ours")
            if lp and lo:
                g["lee_64"] = 1 - lo["ppl"] / lp["ppl"]
            gains.append((budget, g))
    if gains:
        lines += ["", "Ours vs the published algorithm (perplexity reduction):", ""]
        lines += [f"- {b_}: " + ", ".join(f"{k.replace('_', '-')} {v:.1%}" for k, v in g.items()) for b_, g in gains]
        losses = [b_ for b_, g in gains if min(g.values()) < 0]
        lines += ["", "Verdict: " + ("ours beats the published algorithm at every budget on every text." if not losses else
                  "ours does NOT beat the published algorithm everywhere (worse at " + ", ".join(losses) + " on at least one text).")]
        if any(k.startswith("superseded/final/") for k in r):
            lines += ["", "The output-weighted PCA row was measured first, with the same calibration, before the dev32 run "
                      "that chose the plain PCA (1-3% better on dev32 at every budget). On the test windows the two are "
                      "within 2.5% of each other either way; the default stays the dev32 choice."]
    dev = {k: v for k, v in r.items() if k.startswith("dev/")}
    if dev:
        lines += ["", "## History: the first round of decisions (dev: 8 x 512 tokens from the end of the wiki calibration part)", "",
                  "These chose score selection and F = d/r (kept) and 64 x 512 converted propagation (dropped: the test "
                  "and dev32 windows showed it fits wiki at the expense of lee; 8 windows were too few to see it).", "",
                  f"Source dev perplexity: {fmt(dev.get('dev/source', {}).get('ppl'))}.", "",
                  "| setting | " + " | ".join(BUDGETS) + " |", "|---|" + "---|" * len(BUDGETS)]
        names = []
        for k in dev:
            parts = k.split("/")
            if len(parts) == 3 and parts[2] not in names:
                names.append(parts[2])
        for name in names:
            cells = []
            for budget in BUDGETS:
                e = dev.get(f"dev/{budget}/{name}")
                if e is None:
                    cells.append("–")
                else:
                    folds = sorted(set(e.get("freqfold_per_layer", [])))
                    cells.append(f"{e['ppl']:.2f} (F {','.join(map(str, folds))}; err {e['mean_logit_error']:.3f})")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    dev32 = {k: v for k, v in r.items() if k.startswith("dev32/")}
    if dev32:
        src32 = dev32.get("dev32/source", {})
        lines += ["", f"## Dev32: the published algorithm and our candidates ({DEV_WINDOWS} wiki + {DEV_WINDOWS} lee windows)", "",
                  f"Dev32 = the last {DEV_WINDOWS} windows of the wiki calibration part and the first {DEV_WINDOWS} of the lee "
                  "calibration part (lee is never used for calibration). Cells: pooled perplexity (wiki / lee). Source: "
                  + (f"{src32['ppl']:.2f} ({src32['wiki']:.2f} / {src32['lee']:.2f})." if src32 else "–"), "",
                  "| candidate | " + " | ".join(BUDGETS) + " |", "|---|" + "---|" * len(BUDGETS)]
        for name in ["published", *DEV32_CANDIDATES]:
            cells = []
            for budget in BUDGETS:
                e = dev32.get(f"dev32/{budget}/{name}")
                cells.append("–" if e is None else f"{e['ppl']:.2f} ({e['wiki']:.2f} / {e['lee']:.2f})")
            if any(c != "–" for c in cells):
                lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines += ["", "Candidate names: PCA metric (activation = the published plain PCA of [K_nope; V], output = values "
                  "weighted by W_o, attention = also keys weighted by the queries, centre = PCA of the covariance), "
                  "calibration sequences x tokens (seed 42 unless s0), propagation. Every candidate uses score selection "
                  "and F = d/r. " + DEV32_DECISIONS]
    tm = r.get("time/cli-25%")
    act = r.get("time/activations")
    if not tm:
        lines += ["", "## Conversion cost", "", "The /usr/bin/time run of the CLI conversion (phase `time`) was not completed in "
                  "this run; `transmla sweep` records each conversion's wall and CPU seconds in "
                  "results/sweep_smollm2/sweep.json (peak RSS not measured there)."]
    if tm and act:
        cli_command = tm["command"].replace("-m transmla.cli.app", "transmla").replace(str(CACHE / "cli-out"), "OUT")
        lines += ["", "## Conversion cost (25%, the CLI, this CPU)", "",
                  f"`{cli_command}`: wall {tm['wall_s'] / 60:.1f} min, peak RSS {tm['peak_rss_mb']:.0f} MB "
                  f"(user {tm.get('user_s', 0):.0f} s, system {tm.get('system_s', 0):.0f} s). "
                  f"Keeping every layer's q/k/v calibration activations, as the public code does, would take "
                  f"{act['all_layers_qkv_fp32_gb']:.2f} GB for the same {act['tokens']:,} tokens in fp32 (it keeps them twice: "
                  f"~{2 * act['all_layers_qkv_fp32_gb']:.1f} GB); we hold the hidden states ({act['hidden_states_fp32_mb']:.0f} MB), "
                  f"one layer's weights and a {act['one_layer_gram_mb']:.1f} MB gram. The public TransMLA code on the same "
                  "machine (ANCHORS.md): about 5.5 min and 8.2 GB peak RSS."]
    (RESULTS / "transmla_bench.md").write_text("\n".join(lines) + "\n")
    plot(r)


def plot(r: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fracs = [0.5, 0.25, 0.125]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=False)
    for ax, key, title in ((axes[0], "wiki_test_64", "wiki-test (64 x 512)"), (axes[1], "lee_test", "lee-test (29 x 512)")):
        for who, style in (("published", "o--"), ("ours", "s-")):
            ys = [r.get(f"final/{b}/{who}", {}).get(key) for b in BUDGETS]
            if all(y is not None for y in ys):
                ax.plot(fracs, ys, style, label=f"TransMLA {who}")
        if key == "wiki_test_64":
            ax.plot(fracs, [ANCHOR_PUBLIC[b] for b in BUDGETS], "x:", label="public TransMLA code (32 windows)")
        src = r.get("final/source", {}).get(key)
        if src:
            ax.axhline(src, color="gray", lw=1, label="source (100%)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(fracs, ["50%", "25%", "12.5%"])
        ax.set_xlabel("KV cache, fraction of the source")
        ax.set_ylabel("perplexity")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.suptitle("SmolLM2-135M -> MLA, training-free")
    fig.tight_layout()
    fig.savefig(RESULTS / "transmla_ppl_vs_cache.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", default="all", choices=["dev", "dev32", "final", "lee64", "time", "report", "all"])
    parser.add_argument("--only", default=None, help="dev32: only this candidate (or 'published'); final: only this budget")
    args = parser.parse_args()
    torch.manual_seed(0)
    # One thread: on a shared, oversubscribed CPU the small float64 eigen-problems of the
    # conversion run 10-20x slower with a 2-thread OpenMP pool; the forward passes do not gain.
    torch.set_num_threads(int(os.environ.get("TRANSMLA_BENCH_THREADS", "1")))
    b = Bench()
    phases = {"dev": phase_dev, "dev32": lambda b_: phase_dev32(b_, args.only), "final": lambda b_: phase_final(b_, args.only), "lee64": lambda b_: phase_lee64(b_, args.only), "time": phase_time, "report": report}
    for name, fn in phases.items():
        if args.phase in (name, "all"):
            fn(b)


if __name__ == "__main__":
    main()
