"""Our published results for the built-in model: every method, three budgets, two texts.

    .venv/bin/python -m benchmarks.run_all --compute        # compute the CLI-path rows still missing (resumes)
    .venv/bin/python -m benchmarks.run_all                  # only rebuild summary.{json,md,png} from results on disk

Model: smollm2-135m (SmolLM2-135M-Instruct, the built-in GGUF dequantized to fp32), 384 cached
elements per token per layer. Budgets: 50 / 25 / 12.5% of that cache. Texts: the evaluation parts
of the built-in `wiki` and `lee` texts. Protocol (ANCHORS.md): token-level exp(mean NLL) over the
first 32 non-overlapping 512-token windows (wiki: 16,352 scored tokens; lee's evaluation part
holds only 29 windows: 14,819 tokens), fp32, training-free.

Where the numbers come from (each row of the summary names its source):
1. cli: computed here (`--compute`) through the path a user takes: `transmla convert smollm2-135m
   OUT --method M --kv-budget B` with default settings (written to disk, loaded back), then the
   evaluation of `transmla eval` / `transmla sweep` (transmla.eval.evaluate.evaluate_model). Cached in
   benchmarks/results/run_all_cli.json, so an interrupted run resumes.
2. sweep: benchmarks/results/sweep_<method>/sweep.json, written by `transmla sweep` (wiki only).
3. bench: read, not recomputed, from benchmarks/results/transmla_bench.json (benchmarks.transmla_bench)
   and benchmarks/results/mha2mla_smollm2.json (benchmarks.mha2mla_bench): the published algorithms as
   their public code runs them, and every variant those benchmarks try.
4. public: the public TransMLA / MHA2MLA code on the same model and protocol (ANCHORS.md), wiki only.

Writes benchmarks/results/summary.json, summary.md and summary.png.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

from .common import RESULTS, load_json, log, machine

CLI_JSON = RESULTS / "run_all_cli.json"
MODEL = "smollm2-135m"
SOURCE_ELEMENTS = 384
BUDGETS = (0.5, 0.25, 0.125)
TEXTS = ("wiki", "lee")
WINDOWS = 32  # lee's evaluation part holds 29: all of them
METHODS = ("transmla", "mha2mla")
# ANCHORS.md: the public peers' own code, wiki-test, 32 windows.
PUBLIC = {
    "public TransMLA (best of its settings)": {0.5: 33.18, 0.25: 83.60, 0.125: 258.71},
    "public MHA2MLA (S_high, SVD joint)": {0.5: 853.0, 0.25: 5364.0, 0.125: 76568.0},
}
PUBLIC_SOURCE = 18.15
PROTOCOL = (
    "token-level perplexity exp(mean NLL) over the first 32 non-overlapping 512-token windows of the evaluation "
    "part of each built-in text (wiki: 16,352 scored tokens; lee: its 29 windows, 14,819 tokens), no special tokens, "
    "fp32, training-free conversions calibrated on the wiki calibration part (never overlapping the evaluation part)"
)


# --- 1. computed here -------------------------------------------------------------------------


def compute(methods: tuple[str, ...], budgets: tuple[float, ...], keep_models: bool = False) -> None:
    """The CLI-path matrix: source + each method's default settings at each budget, both texts."""
    from transmla.checkpoint.resolve import cache_root
    from transmla.convert.api import convert
    from transmla.eval.evaluate import EvalSettings, evaluate_model
    from transmla.sweep import options_for

    data = load_json(CLI_JSON)
    data.setdefault("rows", {})
    data["protocol"] = PROTOCOL
    data["environment"] = machine()

    def save() -> None:
        RESULTS.mkdir(parents=True, exist_ok=True)
        CLI_JSON.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")

    def evaluate(spec, text: str, measure: bool) -> dict:
        s = EvalSettings(data=text, max_windows=WINDOWS, measure_tokens=64 if measure else 0)
        e = evaluate_model(spec, s, role="model").entry.to_dict()
        keep = ("perplexity", "nll", "tokens", "windows", "kv_elements_per_token_per_layer", "kv_bytes_per_token",
                "kv_lora_rank", "qk_rope_head_dim", "measured_cache", "eval_seconds", "eval_cpu_seconds")
        return {k: e.get(k) for k in keep}

    if "source" not in data or any(t not in data["source"] for t in TEXTS):
        data["source"] = {t: evaluate(MODEL, t, t == "wiki") for t in TEXTS}
        save()
        log("source: " + ", ".join(f"{t} {v['perplexity']:.2f}" for t, v in data["source"].items()))
    for method in methods:
        for budget in budgets:
            key = f"{method}|{budget}"
            if key in data["rows"] and all(t in data["rows"][key] for t in TEXTS):
                continue
            target = cache_root() / "run_all" / f"{method}-{budget:g}"
            options = options_for(method, budget)
            log(f"{key}: converting into {target}")
            t0, c0 = time.perf_counter(), time.process_time()
            result = convert(MODEL, target, options)
            row: dict[str, Any] = {
                "method": method, "budget": budget, "options": options.to_dict(),
                "convert_seconds": time.perf_counter() - t0, "convert_cpu_seconds": time.process_time() - c0,
                "kv_elements_per_token_per_layer": result.kv_elements_per_token_per_layer,
                "kv_lora_rank": result.mla.kv_lora_rank, "qk_rope_head_dim": result.mla.qk_rope_head_dim,
            }
            for text in TEXTS:
                row[text] = evaluate(target, text, text == "wiki")
                log(f"{key}: {text} {row[text]['perplexity']:.2f}")
            data["rows"][key] = row
            save()
            if not keep_models:
                shutil.rmtree(target, ignore_errors=True)


# --- reading every source ---------------------------------------------------------------------


def _row(source: str, label: str, method: str, budget: float, text: str, ppl: float | None, **extra) -> dict:
    return {"source": source, "label": label, "method": method, "budget": budget, "text": text,
            "perplexity": ppl, **extra}


def cli_rows() -> tuple[list[dict], dict]:
    data = load_json(CLI_JSON)
    rows = []
    for r in data.get("rows", {}).values():
        for text in TEXTS:
            if text in r:
                rows.append(_row("cli", f"{r['method']} (CLI defaults)", r["method"], r["budget"], text,
                                 r[text]["perplexity"], tokens=r[text]["tokens"], windows=r[text]["windows"],
                                 kv_elements=r["kv_elements_per_token_per_layer"],
                                 shape=f"{r['kv_lora_rank']} + {r['qk_rope_head_dim']}"))
    source = {t: v["perplexity"] for t, v in data.get("source", {}).items()}
    return rows, source


def sweep_rows() -> tuple[list[dict], dict]:
    rows, source = [], {}
    for path in sorted(RESULTS.glob("sweep_*/sweep.json")):
        s = load_json(path)
        p = s.get("protocol", {})
        if s.get("source_model") != MODEL or p.get("name") != "non-overlapping" or p.get("seq_len") != 512:
            continue
        text = p.get("data")
        if text not in TEXTS or p.get("windows") != min(WINDOWS, 29 if text == "lee" else WINDOWS):
            continue
        source[text] = s["source"]["perplexity"]
        for r in s.get("rows", []):
            label = f"{r['method']} (`transmla sweep`{', ' + r['setting'] if r.get('setting') else ''})"
            rows.append(_row(f"sweep:{path.parent.name}", label, r["method"], r["budget"], text, r["perplexity"],
                             tokens=r["tokens"], kv_elements=r["kv_elements_per_token_per_layer"],
                             shape=f"{r.get('kv_lora_rank')} + {r.get('qk_rope_head_dim')}"))
    return rows, source


def mha2mla_bench_rows() -> tuple[list[dict], dict]:
    """benchmarks/results/mha2mla_smollm2.json: the GQA model, full protocol only."""
    data = load_json(RESULTS / "mha2mla_smollm2.json")
    rows, source = [], {}
    src = data.get("source", {})
    src = src.get("32/29", src)  # keyed by window counts in some versions of the benchmark
    source = {t: src[t]["perplexity"] for t in TEXTS if t in src}
    for v in data.get("settings", {}).values():
        if v.get("model") != "gqa" or v.get("same_as"):
            continue
        if v.get("wiki", {}).get("windows") != 32 or v.get("lee", {}).get("windows") != 29:
            continue
        setting = f"{v['select']}, SVD {v['svd']}, {'activation-aware' if v['weighting'] == 'activation' else 'weight'}"
        for text in TEXTS:
            rows.append(_row("bench:mha2mla", f"mha2mla ({setting}, P={v['rope_pairs']}, 64 x 512 calibration)", "mha2mla", v["budget"], text,
                             v[text]["perplexity"], tokens=v[text]["tokens"], kv_elements=v["kv_elements"],
                             shape=f"{v['kv_lora_rank']} + {v['kv_elements'] - v['kv_lora_rank']}",
                             paper=(v["select"], v["svd"], v["weighting"]) == ("high", "joint", "none")))
    # the CLI defaults (2048 x 16 calibration) on the same test windows, from benchmarks.mha2mla_calib_shape
    shape = load_json(RESULTS / "mha2mla_calib_shape.json").get("results", {})
    for k, v in shape.items():
        if k.startswith("final/"):
            calib = k.split("/")[-1].replace("x", " x ")
            for text, field in (("wiki", "wiki_test_32"), ("lee", "lee_test")):
                rows.append(_row("bench:mha2mla", f"mha2mla (high, SVD joint, activation-aware, P=4, {calib} calibration)",
                                 "mha2mla", v["budget"], text, v[field]))
    return rows, source


_BUDGET_NAMES = {"50%": 0.5, "25%": 0.25, "12.5%": 0.125}
_TRANSMLA_LABELS = {  # transmla_bench result names -> what they are
    "ours": "ours = CLI defaults",
    "previous-defaults": "our previous defaults, chosen on 8 wiki windows",
    "superseded / ours": "ours with the output-weighted PCA, not the default",
}


def transmla_bench_rows() -> tuple[list[dict], dict]:
    """benchmarks/results/transmla_bench.json: every entry holding final wiki/lee numbers.

    Read by shape (an entry with "wiki_test_32" and "lee_test"; its budget named "50%" / "25%" /
    "12.5%" in its key or its "budget" field), so the summary follows that benchmark as it grows.
    """
    data = load_json(RESULTS / "transmla_bench.json")
    rows, source = [], {}

    def walk(node: Any, path: list[str]) -> None:
        if isinstance(node, dict):
            if "wiki_test_32" in node and "lee_test" in node:
                names = [p for p in path if p not in _BUDGET_NAMES and p not in ("final", "results")]
                budget = next((_BUDGET_NAMES[p] for p in path if p in _BUDGET_NAMES), None)
                if budget is None and isinstance(node.get("budget"), (int, float)):
                    budget = float(node["budget"])
                if budget is None and isinstance(node.get("budget"), str):
                    budget = _BUDGET_NAMES.get(node["budget"])
                label = _TRANSMLA_LABELS.get(" / ".join(names), " / ".join(names)) or "transmla"
                if budget is None:
                    if "source" in label:
                        source.update(wiki=node["wiki_test_32"], lee=node["lee_test"])
                    return
                shape = None
                if "kv_lora_rank" in node and "rope_dim" in node:
                    shape = f"{node['kv_lora_rank']} + {node['rope_dim']}"
                for text, key in (("wiki", "wiki_test_32"), ("lee", "lee_test")):
                    rows.append(_row("bench:transmla", f"transmla ({label})", "transmla", budget, text, node[key],
                                     kv_elements=int(round(budget * SOURCE_ELEMENTS)), shape=shape,
                                     paper="published" in label))
                return
            for k, v in node.items():
                walk(v, path + str(k).split("/"))  # transmla_bench keys read "final/25%/ours"
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, path + [str(v.get("name", i)) if isinstance(v, dict) else str(i)])

    walk(data, [])
    return rows, source


def public_rows() -> list[dict]:
    return [_row("public", label, label.split()[1].lower(), b, "wiki", ppl, kv_elements=int(b * SOURCE_ELEMENTS))
            for label, by_budget in PUBLIC.items() for b, ppl in by_budget.items()]


# --- summary ----------------------------------------------------------------------------------


def fmt(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "–"
    return f"{x:,.2f}" if x < 1000 else f"{x:,.0f}"


def summarize() -> dict:

    parts = {"cli": cli_rows(), "sweep": sweep_rows(), "bench:transmla": transmla_bench_rows(),
             "bench:mha2mla": mha2mla_bench_rows()}
    rows = [r for rs, _ in parts.values() for r in rs] + public_rows()
    sources = {name: src for name, (_, src) in parts.items() if src}
    # the best row per (method, budget, text) among all our conversions (not the public code)
    best = {}
    for r in rows:
        if r["source"] == "public" or r["perplexity"] is None:
            continue
        k = (r["method"], r["budget"], r["text"])
        if k not in best or r["perplexity"] < best[k]["perplexity"]:
            best[k] = r
    return {
        "model": f"{MODEL} (SmolLM2-135M-Instruct, built-in GGUF dequantized, fp32), {SOURCE_ELEMENTS} cached elements per token per layer",
        "protocol": PROTOCOL,
        "budgets": list(BUDGETS),
        "texts": list(TEXTS),
        "source_perplexity": sources,
        "rows": rows,
        "best": [best[k] for k in sorted(best, key=lambda k: (k[0], -k[1], k[2]))],
        "environment_of_summary": machine(),
        "machines": {
            "cli": load_json(CLI_JSON).get("environment"),
            "bench:mha2mla": load_json(RESULTS / "mha2mla_smollm2.json").get("meta"),
            "bench:transmla": load_json(RESULTS / "transmla_bench.json").get("meta")
            or load_json(RESULTS / "transmla_bench.json").get("machine"),
        },
    }


def lines_by_label(rows: list[dict]) -> dict[str, dict[tuple[float, str], dict]]:
    out: dict[str, dict[tuple[float, str], dict]] = {}
    for r in rows:
        out.setdefault(r["label"], {})[(r["budget"], r["text"])] = r
    return out


def render_markdown(summary: dict) -> str:
    src = summary["source_perplexity"]
    src_line = "; ".join(
        " / ".join(fmt(s.get(t)) for t in TEXTS) + f" ({name})" for name, s in src.items()
    ) or "not measured yet"
    header = ["method / setting", "from"] + [f"{t} {b:.1%}" for t in TEXTS for b in BUDGETS]
    lines = [
        "# Training-free perplexity against KV-cache size: SmolLM2-135M (built-in)",
        "",
        f"Model: {summary['model']}. Protocol: {summary['protocol']}.",
        "",
        f"Source model perplexity, wiki / lee, as each result file measured it: {src_line}; the public peers' "
        f"code measured {PUBLIC_SOURCE} on wiki.",
        "",
        "Columns: text and kept fraction of the source KV cache (50% = 192, 25% = 96, 12.5% = 48 elements per "
        "token per layer). `from`: cli = `transmla convert --kv-budget` with default settings, written to disk and "
        "evaluated as `transmla eval` does (python -m benchmarks.run_all --compute); sweep = `transmla sweep` output; bench = "
        "benchmarks.transmla_bench / benchmarks.mha2mla_bench results (models assembled in memory); public = the public "
        "peers' own code (ANCHORS.md, wiki only). Lower is better; – = not measured.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    by_label = lines_by_label(summary["rows"])
    rank = {"cli": 0, "sweep": 1, "bench:transmla": 2, "bench:mha2mla": 3, "public": 4}

    def kind(label: str) -> str:  # "sweep:<folder>" rows rank as "sweep"
        source = next(iter(by_label[label].values()))["source"]
        return "sweep" if source.startswith("sweep") else source

    order = sorted(by_label, key=lambda lab: (rank[kind(lab)], lab))
    for label in order:
        cells = by_label[label]
        from_ = next(iter(cells.values()))["source"]
        lines.append("| " + " | ".join([label, from_] + [fmt(cells.get((b, t), {}).get("perplexity"))
                                                         for t in TEXTS for b in BUDGETS]) + " |")
    lines += ["", "## Best of our conversions at each budget", "",
              "The lowest test perplexity any of our measured settings reached: a best-of over the test windows, "
              "not a choice made on them (the defaults were chosen on dev windows; see each benchmark's report).", "",
              "| method | text | budget | perplexity | setting | from |", "|---|---|---|---|---|---|"]
    for r in summary["best"]:
        lines.append(f"| {r['method']} | {r['text']} | {r['budget']:.1%} | {fmt(r['perplexity'])} | {r['label']} | {r['source']} |")
    lines += ["", "![perplexity vs KV cache](summary.png)", ""]
    m = summary["machines"]
    lines += ["Machines: " + "; ".join(
        f"{k}: " + (v.get("machine", "?") + (f", torch {v.get('torch')}, transformers {v.get('transformers')}" if v.get("torch") else ""))
        for k, v in m.items() if isinstance(v, dict)) + ".", ""]
    lines += ["Re-run: see benchmarks/README.md.", ""]
    return "\n".join(lines)


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    from transmla.eval.plots import COLORS

    by_label = lines_by_label(summary["rows"])
    # one line per method as a user runs it, the paper settings, the best variant, the public code
    chosen = [lab for lab in by_label if next(iter(by_label[lab].values()))["source"] in ("cli", "public")]
    if not any(next(iter(by_label[lab].values()))["source"] == "cli" for lab in by_label):
        chosen += [lab for lab in by_label if next(iter(by_label[lab].values()))["source"].startswith("sweep")]
    chosen += [lab for lab in by_label if any(r.get("paper") for r in by_label[lab].values())]
    fig, axes = plt.subplots(1, 2, figsize=(13, 6.2), dpi=110, sharey=True)
    for ax, text in zip(axes, TEXTS):
        color_i = 0
        for label in dict.fromkeys(chosen):
            pts = sorted((b, r["perplexity"]) for (b, t), r in by_label[label].items() if t == text and r["perplexity"])
            if not pts:
                continue
            public = label.startswith("public")
            style = dict(linestyle=":", marker="s", color="0.45" if "TransMLA" in label else "0.7") if public else dict(
                linestyle="-", marker="o", color=COLORS[color_i % len(COLORS)])
            if not public:
                color_i += 1
            xs, ys = zip(*pts)
            ax.plot(xs, ys, label=label, linewidth=2, markersize=5, **style)
        best = [r for r in summary["best"] if r["text"] == text]
        for method, marker in (("transmla", "*"), ("mha2mla", "P")):
            pts = sorted((r["budget"], r["perplexity"]) for r in best if r["method"] == method)
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker, color="black", markersize=11, linestyle="none", label=f"best {method} variant")
                for x, y in pts:
                    ax.annotate(fmt(y), (x, y), textcoords="offset points", xytext=(7, -4), fontsize=8)
        srcs = [s.get(text) for s in summary["source_perplexity"].values() if s.get(text)]
        if srcs:
            ax.axhline(srcs[0], color="black", linestyle="--", linewidth=1.2, label=f"source model: {fmt(srcs[0])}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ticks = [0.125, 0.25, 0.5, 1.0]
        ax.set_xticks(ticks)
        ax.set_xticklabels([f"{t:.1%}\n({int(t * SOURCE_ELEMENTS)} el.)" for t in ticks], fontsize=8)
        ax.minorticks_off()
        ax.set_xlim(0.1, 1.2)
        ax.grid(True, alpha=0.3)
        ax.set_title(f"{text}: evaluation part, {'32' if text == 'wiki' else '29'} x 512 tokens", fontsize=10)
        ax.set_xlabel("KV cache kept (fraction of the source's)")
    axes[0].set_ylabel("perplexity (log scale, lower is better)")
    handles: dict[str, Any] = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab.startswith("source model"):
                continue
            handles.setdefault(lab, h)
        src = [(h, lab) for h, lab in zip(*ax.get_legend_handles_labels()) if lab.startswith("source model")]
        if src:
            ax.legend(*zip(*src), fontsize=8, loc="lower left")
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle("SmolLM2-135M, training-free conversion: perplexity vs KV cache", fontsize=12)
    rows_of_legend = math.ceil(len(handles) / 3)
    fig.tight_layout(rect=(0, 0.035 * rows_of_legend + 0.02, 1, 1))
    fig.savefig(path)
    plt.close(fig)


def write_summary() -> dict:
    summary = summarize()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (RESULTS / "summary.md").write_text(render_markdown(summary))
    plot(summary, RESULTS / "summary.png")
    log(f"wrote {RESULTS / 'summary.md'}, summary.json, summary.png ({len(summary['rows'])} rows)")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compute", action="store_true", help="compute the missing CLI-path rows first (slow)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--keep-models", action="store_true")
    args = parser.parse_args()
    if args.compute:
        compute(tuple(m for m in args.methods.split(",") if m), BUDGETS, args.keep_models)
    write_summary()


if __name__ == "__main__":
    main()
