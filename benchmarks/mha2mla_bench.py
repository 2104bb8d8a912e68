"""MHA2MLA, training-free, on the built-in SmolLM2-135M (GQA) and its MHA copy.

    python -m benchmarks.mha2mla_bench            # run (resumes: settings already in the JSON are skipped)
    python -m benchmarks.mha2mla_bench --report   # only rewrite the Markdown table and the plot

Grid: selection {high, low, uniform, 2norm} x SVD {joint, split} x weighting {none, activation}
at 50 / 25 / 12.5% of the source cache (384 elements per token per layer: 192 / 96 / 48), with
P = 4 rope pairs per key head (the published d/16) and R = budget - g*2P.
The MHA copy (key/value heads repeated, same function) is converted at the same absolute cache
sizes; its rope part is 9 heads x 2P, so at 48 elements it keeps P = 1 pair per head.
Protocol (ANCHORS.md): calibration 64 x 512 tokens of the wiki calibration part (seed 0);
perplexity over non-overlapping 512-token windows of the evaluation parts: the first 32 of wiki,
all 29 of lee (its evaluation part is 29 windows long).

CPU economy: the calibration statistics are collected once (GQA model, "original" propagation)
and reused for every setting. The MHA copy needs no calibration run of its own: its attention
inputs are the GQA model's (same function, layer by layer), so the gram and the query pair norms
are identical and key head h's pair norms are those of GQA key head h // 3. Each layer's SVDs are
done once per (selection, svd, weighting) and truncated for the three budgets; models are
assembled in memory. For the fixed selections (high/low/uniform) the MHA copy at rank R is the
same function as the GQA model at rank R (its [W_k,nope; W_v] rows are the GQA rows repeated, so
both the weight and the activation-weighted SVDs span the same latent); where the GQA grid already
holds that R the result is reused (marked "same_as"), after one check that both agree.
"""

from __future__ import annotations

import argparse
import fnmatch
import itertools
import json
import math
import time
from dataclasses import replace

import torch

from .common import RESULTS, load_json, log, machine, save_json

JSON_PATH = RESULTS / "mha2mla_smollm2.json"
MD_PATH = RESULTS / "mha2mla_smollm2.md"
PNG_PATH = RESULTS / "mha2mla_smollm2.png"

BUDGETS = (0.5, 0.25, 0.125)
STRATEGIES = ("high", "low", "uniform", "2norm")
SVDS = ("joint", "split")
WEIGHTINGS = ("none", "activation")
SOURCE_ELEMENTS = 384
TEXTS = ("wiki", "lee")
PROTOCOL = (
    "calibration: 64 x 512 tokens of the wiki calibration part, seed 0, statistics collected once; perplexity: "
    "token-level exp(mean NLL) over the first N non-overlapping 512-token windows of the evaluation parts "
    "(wiki: 32 windows = 16,352 scored tokens; lee: its evaluation part holds 29 windows = 14,819 tokens); "
    "training-free, fp32"
)
ANCHOR_MHA2MLA = {0.5: 853.0, 0.25: 5364.0, 0.125: 76568.0}  # public MHA2MLA S_high joint, wiki-test, 32 windows
ANCHOR_MHA2MLA_2NORM = {0.5: 1545.0, 0.25: 12189.0, 0.125: 79107.0}
ANCHOR_TRANSMLA = {0.5: 33.18, 0.25: 83.60, 0.125: 258.71}  # public TransMLA best at each budget


def key(model: str, budget: float, select: str, svd: str, weighting: str, pairs: int) -> str:
    return f"{model}|{budget}|{select}|{svd}|{weighting}|P{pairs}"


# -- the run -------------------------------------------------------------------------------------


def pairs_for(model: str, budget: float) -> int:
    return 1 if model == "mha" and budget == 0.125 else 4


def main_run(args) -> None:
    import transmla  # noqa: F401
    from transformers import AutoTokenizer

    from transmla.checkpoint.resolve import cache_root, load_config, load_model, resolve_model_dir
    from transmla.convert.assemble import assemble_model
    from transmla.convert.calibrate import LayerStats, collect_layer_stats
    from transmla.convert.layers import source_layers
    from transmla.convert.mha2mla.budget import mha2mla_budget
    from transmla.convert.mha2mla.method import MHA2MLAOptions
    from transmla.convert.mha2mla.mha_copy import make_mha_copy
    from transmla.convert.registry import get_method
    from transmla.data.calib import calibration_chunks
    from transmla.data.texts import load_text
    from transmla.eval.perplexity import perplexity, tokenize_text
    from transmla.families import attention_geometry

    torch.set_num_threads(args.threads)
    method = get_method("mha2mla")
    data = load_json(JSON_PATH)
    data.setdefault("settings", {})
    data["meta"] = {
        **machine(),
        "model": "smollm2-135m (SmolLM2-135M-Instruct, built-in GGUF dequantized, fp32)",
        "protocol": PROTOCOL,
        "source_kv_elements_per_token_per_layer": SOURCE_ELEMENTS,
    }
    gqa_dir = resolve_model_dir("smollm2-135m")
    mha_dir = cache_root() / "smollm2-135m-mha"
    if not (mha_dir / "config.json").is_file():
        log(f"writing the MHA copy to {mha_dir}")
        make_mha_copy(gqa_dir, mha_dir, force=True)
    tok = AutoTokenizer.from_pretrained(gqa_dir)
    eval_ids = {name: tokenize_text(tok, load_text(name, part="eval")) for name in TEXTS}
    # windows wanted per text (capped by what the text holds: lee's evaluation part is 29 windows)
    wanted = {
        name: min(n if n is not None else 10**9, eval_ids[name].numel() // 512)
        for name, n in (("wiki", args.wiki_windows), ("lee", args.lee_windows))
    }

    def complete(entry: dict | None) -> bool:
        return entry is not None and all(entry.get(t, {}).get("windows", 0) >= wanted[t] for t in TEXTS)

    def evaluate(model) -> dict:
        out = {}
        for name in TEXTS:
            t = time.time()
            r = perplexity(model, eval_ids[name], seq_len=512, max_windows=wanted[name], progress=False)
            out[name] = {"perplexity": r.perplexity, "tokens": r.tokens, "windows": r.windows, "seconds": round(time.time() - t, 1)}
        return out

    source = data.setdefault("source", {})
    if "wiki" in source:  # results written before per-window-count source entries
        source["32/29"] = {t: source.pop(t) for t in TEXTS}
    tag = f"{wanted['wiki']}/{wanted['lee']}"
    if tag not in source:
        model, _ = load_model(gqa_dir)
        source[tag] = evaluate(model)
        save_json(JSON_PATH, data, newline=True)
        log(f"source ({tag} windows): {source[tag]}")
        del model
    if "mha_copy_check" not in data:
        a, _ = load_model(gqa_dir)
        b, _ = load_model(mha_dir)
        ids = eval_ids["wiki"][:512][None]
        with torch.inference_mode():
            diff = (a(ids).logits - b(ids).logits).abs().max().item()
        data["mha_copy_check"] = {"max_abs_logit_diff_first_window": diff, "kv_heads": b.config.num_key_value_heads}
        save_json(JSON_PATH, data, newline=True)
        log(f"MHA copy check: {data['mha_copy_check']}")
        del a, b

    stats_path = cache_root() / "bench" / "mha2mla_stats_smollm2.pt"
    config = load_config(gqa_dir)
    if stats_path.is_file():
        stats = [LayerStats(**s) for s in torch.load(stats_path, weights_only=True)]
    else:
        calib = calibration_chunks(tok, "wiki", 64, 512, 0)
        t = time.time()
        stats = collect_layer_stats(gqa_dir, config, calib, pair_norms=True, progress=False)
        data["calibration_seconds"] = round(time.time() - t, 1)
        stats_path.parent.mkdir(parents=True, exist_ok=True)
        torch.save([s.__dict__ for s in stats], stats_path)
        save_json(JSON_PATH, data, newline=True)
        log(f"calibration statistics collected in {data['calibration_seconds']} s")
    group = attention_geometry(config).group_size
    # MHA copy: same attention inputs, same queries; key head h is GQA key head h // n.
    mha_stats = [replace(s, k_pair_norm=s.k_pair_norm.repeat_interleave(group, dim=0)) for s in stats]

    models = {"gqa": (gqa_dir, stats), "mha": (mha_dir, mha_stats)}
    for model_name in args.models:
        src_dir, layer_stats = models[model_name]
        cfg = load_config(src_dir)
        geo = attention_geometry(cfg)
        sources = list(source_layers(src_dir, cfg))
        for select, svd, weighting in itertools.product(args.strategies, SVDS, WEIGHTINGS):
            todo = []
            for budget in BUDGETS:
                P = pairs_for(model_name, budget)
                k = key(model_name, budget, select, svd, weighting, P)
                if args.only and not any(fnmatch.fnmatch(k, pat) for pat in args.only):
                    continue
                old = data["settings"].get(k)
                if complete(old) and not (old.get("same_as") and not complete(data["settings"].get(old["same_as"]))):
                    continue
                R = mha2mla_budget(SOURCE_ELEMENTS, budget, geo.num_kv_heads, P)
                same = twin(data, model_name, select, svd, weighting, P, R)
                if same is not None and complete(data["settings"][same]) and data.get("same_function_check", {}).get("verified"):
                    data["settings"][k] = {**data["settings"][same], "model": model_name, "budget": budget, "same_as": same}
                    save_json(JSON_PATH, data, newline=True)
                    log(f"{k}: same function as {same}, reused")
                    continue
                todo.append((budget, P, R, k))
            if not todo:
                continue
            t0 = time.time()
            built = {}
            for P in sorted({P for _, P, _, _ in todo}):
                items = [(b, R, k) for b, p, R, k in todo if p == P]
                ranks = [R for _, R, _ in items]
                # The method's plan for this setting; one SVD per layer serves every budget's rank
                # (MHA2MLA.convert_layer_at_ranks: each result is convert_layer at that rank).
                plan = method.plan(geo, MHA2MLAOptions(kv_lora_rank=ranks[0], rope_pairs=P, rope_select=select,
                                                       svd=svd, svd_weighting=weighting))
                layers = {k: [] for _, _, k in items}
                pair_info = []
                for src, st in zip(sources, layer_stats):
                    converted = method.convert_layer_at_ranks(plan, src, st, ranks)
                    pair_info.append(converted[0][1]["pairs"])
                    for (_, _, k), (layer, info) in zip(items, converted):
                        layers[k].append((layer, (info["rank_k"], info["rank_v"]) if "rank_k" in info else None))
                for budget, R, k in items:
                    built[k] = (budget, P, R, layers[k], pair_info)
            convert_s = round(time.time() - t0, 1)
            for k, (budget, P, R, layer_list, pair_info) in built.items():
                model = assemble_model(src_dir, cfg, [m for m, _ in layer_list], {"name": "mha2mla"})
                t = time.time()
                res = evaluate(model)
                del model
                entry = {
                    "model": model_name, "budget": budget, "select": select, "svd": svd, "weighting": weighting,
                    "rope_pairs": P, "kv_lora_rank": R, "kv_elements": R + geo.num_kv_heads * 2 * P,
                    "convert_seconds_all_budgets": convert_s, "eval_seconds": round(time.time() - t, 1), **res,
                }
                old = data["settings"].get(k)
                if old is not None and not old.get("same_as"):
                    entry["earlier"] = {t: old[t] for t in TEXTS if t in old}  # e.g. the 8-window screening
                if svd == "split":
                    entry["rank_k_per_layer"] = [r[0] for _, r in layer_list]
                if select == "2norm" and model_name == "gqa":
                    entry["pairs_per_layer"] = pair_info
                data["settings"][k] = entry
                same = twin(data, model_name, select, svd, weighting, P, R)
                if same is not None and "same_function_check" not in data:
                    a, b = data["settings"][same]["wiki"], res["wiki"]
                    if a["windows"] == b["windows"]:
                        ok = abs(a["perplexity"] - b["perplexity"]) <= 1e-3 * a["perplexity"]
                        data["same_function_check"] = {"mha": k, "gqa": same, "wiki": [a["perplexity"], b["perplexity"]], "verified": ok}
                        log(f"same-function check: {data['same_function_check']}")
                save_json(JSON_PATH, data, newline=True)
                log(f"{k}: wiki {res['wiki']['perplexity']:.2f} lee {res['lee']['perplexity']:.2f} ({res['wiki']['windows']}/{res['lee']['windows']} windows)")
            write_report(data)
    write_report(data)


def twin(data: dict, model: str, select: str, svd: str, weighting: str, P: int, R: int) -> str | None:
    """For the MHA copy with a fixed selection: the GQA result with the same P and R (the same function)."""
    if model != "mha" or select == "2norm":
        return None
    for k, v in data["settings"].items():
        if v.get("model") == "gqa" and not v.get("same_as") and (
            v["select"], v["svd"], v["weighting"], v["rope_pairs"], v["kv_lora_rank"]
        ) == (select, svd, weighting, P, R):
            return k
    return None


# -- the report ---------------------------------------------------------------------------------


def fmt(x) -> str:
    if x is None:
        return "–"
    if not math.isfinite(x):
        return "inf"
    return f"{x:.1f}" if x < 1e4 else f"{x:.3g}"


FULL = {"wiki": 32, "lee": 29}


def is_full(v: dict) -> bool:
    return all(v.get(t, {}).get("windows", 0) >= FULL[t] for t in TEXTS)


def cell(v: dict | None) -> str:
    if v is None:
        return "–"
    mark = "" if is_full(v) else "*"
    same = " ≡" if v.get("same_as") else ""
    return f"{fmt(v['wiki']['perplexity'])} / {fmt(v['lee']['perplexity'])}{mark}{same}"


def write_report(data: dict) -> None:
    settings = data.get("settings", {})
    source = data.get("source", {})
    meta = data.get("meta", {})
    lines = ["# MHA2MLA on SmolLM2-135M, training-free", ""]
    lines += [
        f"Machine: {meta.get('machine', '?')}; torch {meta.get('torch', '?')}, transformers {meta.get('transformers', '?')}.",
        "",
        f"Protocol: {meta.get('protocol', PROTOCOL)}.",
        "Cells marked * were measured on the first 8 windows of each text only (a screening pass: the",
        "shared 2-core CPU evaluated about one 512-token window per 12 s, too slow for every cell at full",
        "length); unmarked cells use 32 wiki windows and all 29 lee windows. ≡: the MHA copy's conversion is",
        "the same function as the GQA cell with the same P and R (repeated K/V rows span the same latent),",
        "so that number is reused; one such pair was run both ways and agreed.",
        "",
        "Source model (384 cached elements per token per layer), wiki / lee: "
        + ", ".join(f"{fmt(v['wiki']['perplexity'])} / {fmt(v['lee']['perplexity'])} ({k} windows)" for k, v in sorted(source.items())),
        "",
    ]
    for model, title in (("gqa", "SmolLM2-135M (GQA, 3 key heads)"), ("mha", "MHA copy (9 key heads, same function)")):
        rows = [v for v in settings.values() if v.get("model") == model]
        if not rows:
            continue
        g = 3 if model == "gqa" else 9
        lines += [f"## {title}", "", "wiki / lee perplexity; column header: cache = R + g*2P elements per token per layer.", ""]
        head, sep = "| selection | svd | weighting |", "|---|---|---|"
        for b in BUDGETS:
            P = pairs_for(model, b)
            R = round(SOURCE_ELEMENTS * b) - g * 2 * P
            head += f" {round(SOURCE_ELEMENTS * b)} = {R} + {g * 2 * P} (P={P}) |"
            sep += "---|"
        lines += [head, sep]
        for select, svd, weighting in itertools.product(STRATEGIES, SVDS, WEIGHTINGS):
            cells = [cell(settings.get(key(model, b, select, svd, weighting, pairs_for(model, b)))) for b in BUDGETS]
            lines.append(f"| {select} | {svd} | {weighting} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Beside the public peers and TransMLA (wiki-test, 32 windows)", ""]
    lines += [
        "| cache | public MHA2MLA S_high joint / 2-norm | ours, same setting (high, joint, none) | ours, best grid setting (64 x 512 calibration) | ours, CLI defaults (high, joint, activation; 2048 x 16 calibration) | TransMLA (ours) | public TransMLA |",
        "|---|---|---|---|---|---|---|",
    ]
    cli = cli_defaults_by_budget()
    tm = transmla_by_budget()
    best_by_budget, vs_best, vs_published = {}, [], []
    for b in BUDGETS:
        ours = settings.get(key("gqa", b, "high", "joint", "none", 4))
        best = best_screened(settings, b)
        best_by_budget[b] = best
        best_s = "–" if best is None else (f"{fmt(best['wiki']['perplexity'])}{'' if is_full(best) else '*'} "
                                          f"({best['select']}, {best['svd']}, {best['weighting']})")
        ours_s = "–" if ours is None else fmt(ours["wiki"]["perplexity"]) + ("" if is_full(ours) else "*")
        tm_ppl, tm_plan = tm.get(b, (None, None))
        lines.append(
            f"| {round(SOURCE_ELEMENTS * b)} | {fmt(ANCHOR_MHA2MLA[b])} / {fmt(ANCHOR_MHA2MLA_2NORM[b])} | {ours_s} | {best_s} | "
            f"{fmt(cli.get(b))} | {fmt(tm_ppl)}{tm_plan or ''} | {fmt(ANCHOR_TRANSMLA[b])} |"
        )
        ours_best = min((x for x in (best and best["wiki"]["perplexity"], cli.get(b)) if x), default=None)
        if tm_ppl and ours_best:
            vs_best.append(f"{ours_best / tm_ppl:.1f}x")
            vs_published.append(f"{ANCHOR_MHA2MLA[b] / tm_ppl:.0f}x")
    repair = []
    for b in BUDGETS:
        none, act = (settings.get(key("gqa", b, "high", "joint", w, 4)) for w in WEIGHTINGS)
        pair = matched_wiki(none, act)
        repair.append("–" if pair is None else f"{pair[0] / pair[1]:.0f}x")
    best_full = all(v is not None and is_full(v) for v in best_by_budget.values())
    lines += [
        "",
        "The best MHA2MLA setting per budget is the GQA cell with the lowest wiki perplexity in the 8-window "
        "screening; " + ("each was then re-run on the full 32 wiki + 29 lee windows, the number shown."
                         if best_full else "those not marked * were then re-run on the full windows.")
        + " The CLI defaults column calibrates on the same 32,768 tokens cut into 2048 x 16, chosen on dev windows "
        "(benchmarks/results/mha2mla_calib_shape.md); every grid cell uses 64 x 512.",
        "",
        f"Which wins where, and why: TransMLA wins at every budget, training-free: its wiki perplexity is "
        f"{' / '.join(vs_best)} lower than our best MHA2MLA conversion at 50 / 25 / 12.5%, and {' / '.join(vs_published)} "
        "lower than MHA2MLA as published (public numbers). "
        "Its RoRoPE rotation concentrates each frequency's key energy across heads before choosing what stays rope, "
        "and its joint PCA fits the latent to measured activations; MHA2MLA drops RoPE from fixed pairs of every head "
        "and (as published) fits the latent to the weights alone. Whitening the SVD by the calibration input "
        f"covariance (activation) is the largest single repair of MHA2MLA ({' / '.join(repair)} lower wiki perplexity "
        "at 50 / 25 / 12.5% for high/joint on the GQA model, compared on the same windows) and is our default; joint "
        "beats split at the small budgets (split spends rank on K and V separately and collapses at 12.5%); the four "
        "selections differ less than the weighting does. On the MHA copy (9 key heads) the rope part costs 3x more "
        "cache per pair, so the same budget leaves less latent and every cell is worse than on the GQA model.",
    ]
    lines.append("")
    MD_PATH.write_text("\n".join(lines) + "\n")
    plot(data)


def wiki_on(v: dict | None, windows: int) -> float | None:
    """The cell's wiki perplexity on `windows` windows: its current number or the screening it replaced."""
    if v is None:
        return None
    for run in (v, v.get("earlier", {})):
        if run.get("wiki", {}).get("windows") == windows:
            return run["wiki"]["perplexity"]
    return None


def matched_wiki(a: dict | None, b: dict | None) -> tuple[float, float] | None:
    """Two cells' wiki perplexities on the same windows: the full 32 if both have it, else the 8-window screening."""
    for windows in (FULL["wiki"], 8):
        x, y = wiki_on(a, windows), wiki_on(b, windows)
        if x is not None and y is not None:
            return x, y
    return None


def best_screened(settings: dict, budget: float) -> dict | None:
    """The GQA cell with the lowest 8-window screening wiki perplexity at this budget."""
    cands = [v for v in settings.values() if v.get("model") == "gqa" and v["budget"] == budget and wiki_on(v, 8) is not None]
    return min(cands, key=lambda v: wiki_on(v, 8)) if cands else None


def cli_defaults_by_budget() -> dict:
    """MHA2MLA with its CLI defaults (their calibration shape), wiki-test 32 windows, from benchmarks.mha2mla_calib_shape."""
    from transmla.convert.mha2mla.method import DEFAULT_CALIBRATION

    path = RESULTS / "mha2mla_calib_shape.json"
    if not path.is_file():
        return {}
    results = json.loads(path.read_text()).get("results", {})
    n, t = DEFAULT_CALIBRATION
    return {b: results[f"final/{b}/{n}x{t}"]["wiki_test_32"] for b in BUDGETS if f"final/{b}/{n}x{t}" in results}


def transmla_by_budget() -> dict:
    """TransMLA (our defaults) wiki-test perplexity (32 windows) and its plan by budget, from benchmarks/results/transmla_bench.json."""
    path = RESULTS / "transmla_bench.json"
    if not path.is_file():
        return {}
    results = json.loads(path.read_text()).get("results", {})
    names = {0.5: "50%", 0.25: "25%", 0.125: "12.5%"}
    out = {}
    for b, name in names.items():
        row = results.get(f"final/{name}/ours")
        if row:
            out[b] = (row["wiki_test_32"], f" ({row['plan']['kv_lora_rank']} + {row['plan']['rope_dim']})")
    return out


def plot(data: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = data.get("settings", {})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    xs = [SOURCE_ELEMENTS * b for b in BUDGETS]
    for ax, model in zip(axes, ("gqa", "mha")):
        for select in STRATEGIES:
            for svd in SVDS:
                for weighting in WEIGHTINGS:
                    ys = [settings.get(key(model, b, select, svd, weighting, pairs_for(model, b)), {}).get("wiki", {}).get("perplexity") for b in BUDGETS]
                    if all(y is None for y in ys):
                        continue
                    style = "-" if weighting == "activation" else ":"
                    marker = "o" if svd == "joint" else "s"
                    ax.plot(xs, [y if y is not None else float("nan") for y in ys], style, marker=marker, label=f"{select}/{svd}/{weighting}", alpha=0.8)
        ax.plot(xs, [ANCHOR_MHA2MLA[b] for b in BUDGETS], "k--", label="public MHA2MLA S_high joint")
        ax.plot(xs, [ANCHOR_TRANSMLA[b] for b in BUDGETS], "k-.", label="public TransMLA")
        src = data.get("source", {}).get("32/29", {}).get("wiki", {}).get("perplexity")
        if src:
            ax.axhline(src, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(xs, [f"{int(x)}" for x in xs])
        ax.set_xlabel("cached elements per token per layer")
        ax.set_title("SmolLM2-135M (GQA)" if model == "gqa" else "its MHA copy")
    axes[0].set_ylabel("wiki-test perplexity (training-free)")
    axes[1].legend(fontsize=6, ncol=2, loc="upper right")
    fig.tight_layout()
    fig.savefig(PNG_PATH, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--report", action="store_true", help="only rewrite the Markdown and the plot")
    parser.add_argument("--models", default="gqa,mha")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--wiki-windows", type=int, default=32)
    parser.add_argument("--lee-windows", type=int, default=None, help="default: all (29)")
    parser.add_argument("--only", action="append", default=[], help="fnmatch pattern on model|budget|select|svd|weighting|P")
    args = parser.parse_args()
    args.models = args.models.split(",")
    args.strategies = args.strategies.split(",")
    if args.report:
        write_report(load_json(JSON_PATH))
    else:
        main_run(args)


if __name__ == "__main__":
    main()
