"""The strongest training-free peer, CARE (FutureMLS-Lab/CARE, ICLR 2026), run with its own code on our
models and texts beside the CLI's conversions at the same cache per token (issue 36).

    .venv/bin/python -m benchmarks.care_peer --care DIR                    # SmolLM2 at 50% and 25%
    .venv/bin/python -m benchmarks.care_peer --care DIR --runs care-0.25   # some runs
    .venv/bin/python -m benchmarks.care_peer --care DIR --model qwen2.5-coder-1.5b   # the real 1.5B at 25%
    .venv/bin/python -m benchmarks.care_peer --care DIR --model qwen2.5-coder-1.5b --screen 256+64,96+32 --samples 8
                                                       # CARE at some shapes, few sequences, 2 wiki windows
    .venv/bin/python -m benchmarks.care_peer --report                      # only the table

DIR is a checkout of FutureMLS-Lab/CARE (commit c3c2126; never copied into this repository); its `src` is
imported as is, but for its one data container: its utils import `datasets` (Hugging Face's) for
Dataset.from_dict / filter / set_transform around a list of strings, and datasets 5.2 with pyarrow 26 cannot
even build a Dataset here (its fingerprint pickling fails on pyarrow's MonthDayNano); a stand-in with those four
operations (peer_datasets.Rows: the same row order, filtering and per-batch transform) takes its place.

CARE is run as its own scripts run it (scripts/qwen2.5-1.5B/run_care.sh): `partial_rope` (its RoRoPE with
freqfold 4 and collapse = head_dim / qk_mqa_dim), then `low_rank_qkv` with --kv-decomp-method care (the
covariance-weighted SVD with the square root, layer by layer on the propagated hidden states), damping 0.01,
calibration sequences of 256 tokens in batches of 2, seed 42, every other flag its CLI's default. What
differs, and why: fp32 on the CPU (its scripts: fp16 on a GPU); 128 calibration sequences instead of 256
(32K tokens, as many as our CLI's statistics; `--samples`); its calibration text is our built-in wiki text's
calibration part (its get_dataset downloads wikitext2, which cannot be downloaded here; the same kind of
text), handed to its own prepare_dataloader as a list of paragraphs; its in-run perplexity
evaluation is off (no test loader; freqfold is fixed, as its scripts pass it). Shapes: CARE's cache per
token per layer is kv_lora_rank + qk_mqa_dim; each run takes the CLI's exportable shape at that budget.

Measured, on test material only (CARE is a peer, not a choice): perplexity on the first 32 windows of 512
tokens of the wiki, lee and code evaluation parts (what `transmla eval --max-windows 32` scores); the
passkey likelihood probe (transmla.eval.key_probe, as benchmarks/retrieval_ladder but with the test seed 0,
lengths 1K/2K/4K, depths 10/50/90, 5 keys: 45 prompts) and the recall task (`transmla eval --task recall`,
60 items, seed 0). The CLI's conversions at the same budgets (out/passkey's folders, made by
benchmarks/passkey) and the source are measured by the same code.

On the Qwen2.5-Coder-1.5B (`--model qwen2.5-coder-1.5b`) CARE runs at the CLI's 25% shape (96 + 32, collapse 4;
its own script for this model family, scripts/qwen2.5-1.5B/run_care.sh, keeps 256 + 64 = 62.5%) with the
settings above, and is measured as benchmarks.qwen2_1p5b measures the CLI's conversions: perplexity on the first
16 windows of 512 tokens of wiki, lee, code and Debian's licence texts, fp32 (the same windows and scoring code as
`transmla eval --max-windows 16`). The key probe and the recall task are not run there: on one thread of this CPU
the 1.5B reads about 20 tokens a second, so they would take hours. The source's and the CLI's rows are read
from benchmarks/results/qwen2_1p5b.json (the CLI's conversion there: transmla-0.25-cli), not measured again.

Writes benchmarks/results/care_peer_smollm2.json and .md (care_peer_qwen2_1p5b for the 1.5B), with the CPU and
the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from transmla.checkpoint.resolve import cache_root

from .common import RESULTS, ResultCache, log, machine
from .peer_datasets import Rows, datasets_stand_in

ROOT = Path(__file__).resolve().parent.parent
CARE_COMMIT = "c3c2126"
SEQ = 512
PROBE = dict(depths="10,50,90", keys=5, seed=0)
PROBE_LENGTHS = [1024, 2048, 4096]
RECALL = dict(items=60, context_tokens=1024, task_seed=0)
FREQFOLD, DAMPING, CAL_SEQ, CAL_BATCH, SEED = 4, 0.01, 256, 2, 42


@dataclass(frozen=True)
class Target:
    """One source model's comparison: CARE's runs, the CLI's conversions beside them, what is measured."""

    model: str
    stem: str  # benchmarks/results/STEM.json and .md
    # run -> (fraction of the source's cache, CARE's kv_lora_rank, qk_mqa_dim)
    care_runs: dict[str, tuple[float, int, int]]
    # run -> (fraction, the CLI's conversion at that budget: a folder, relative to the repository root or absolute)
    cli_runs: dict[str, tuple[float, str]]
    texts: tuple[str, ...]
    windows: int
    tasks: bool  # the key probe and the recall task too
    # the source's and the CLI's rows read from another benchmark's JSON (run -> its key there), not measured here
    reference: tuple[str, dict[str, str]] | None = None


TARGETS = {
    # SmolLM2 keeps 3 x 64 x 2 = 384 elements per token per layer; the CLI's exportable shapes at 50% and 25% are
    # 128 + 64 and 64 + 32 (benchmarks/passkey's folders)
    "smollm2-135m": Target(
        "smollm2-135m", "care_peer_smollm2", {"care-0.5": (0.5, 128, 64), "care-0.25": (0.25, 64, 32)},
        {"transmla-0.5": (0.5, "out/passkey/transmla-50-shared"), "transmla-0.25": (0.25, "out/passkey/transmla-25-shared")},
        ("wiki", "lee", "code"), 32, True),
    # Qwen2.5-Coder-1.5B keeps 2 x 128 x 2 = 512; the CLI's 25% is 96 + 32 (benchmarks/qwen2_1p5b's transmla-0.25-cli)
    "qwen2.5-coder-1.5b": Target(
        "qwen2.5-coder-1.5b", "care_peer_qwen2_1p5b", {"care-0.25": (0.25, 96, 32)},
        {"transmla-0.25": (0.25, str(cache_root() / "bench-qwen2" / "transmla-0.25-cli"))},
        ("wiki", "lee", "code", "licences"), 16, False,
        ("qwen2_1p5b", {"source": "source@16", "transmla-0.25": "transmla-0.25-cli@16"})),
}


def care_model(care_src: Path, source_dir: Path, kv_lora_rank: int, qk_mqa_dim: int, samples: int):
    """CARE's conversion of the source, in memory: its partial_rope then its low_rank_qkv (method care)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from transmla.data.texts import load_text

    datasets_stand_in()
    sys.path.insert(0, str(care_src))
    from cli.convert import parse_args  # CARE's own CLI, for its defaults
    from lora_qkv import low_rank_qkv
    from partial_rope import partial_rope
    from utils import prepare_dataloader

    model = AutoModelForCausalLM.from_pretrained(source_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    tok = AutoTokenizer.from_pretrained(source_dir)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    head_dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    args = parse_args(["--model-path", str(source_dir), "--save-path", "-", "--dtype", "fp32", "--kv-lora-rank",
                       str(kv_lora_rank), "--qk-mqa-dim", str(qk_mqa_dim), "--collapse", str(head_dim // qk_mqa_dim),
                       "--freqfold", str(FREQFOLD), "--kv-decomp-method", "care", "--cwsvd-percdamp", str(DAMPING),
                       "--cal-max-seqlen", str(CAL_SEQ), "--cal-batch-size", str(CAL_BATCH), "--cal-nsamples",
                       str(samples), "--seed", str(SEED), "--ppl-eval-batch-size", "0"])
    kwargs = vars(args) | {"collapse": int(args.collapse)}
    paragraphs = [p for p in load_text("wiki", "calib").split("\n\n") if p.strip()]
    train = prepare_dataloader(dataset=Rows.from_dict({"text": paragraphs}), tokenizer=tok,
                               max_seqlen=CAL_SEQ, batch_size=CAL_BATCH, nsamples=samples, seed=SEED)
    with torch.no_grad():
        model = partial_rope(model, tok, train, None, **kwargs)
        model = low_rank_qkv(model, tok, train, None, **kwargs)
    return model.eval(), tok


def measure(model, tok, target: Target, save=lambda partial: None) -> dict:
    """Test perplexity on each text, then (target.tasks) the key probe and the recall task; save(what is measured
    so far) after each text (a stopped run keeps those)."""
    from transmla.data.calib import tokenize_text
    from transmla.data.texts import load_text
    from transmla.eval.choice_tasks import ChoiceSettings, recall_items, score_items
    from transmla.eval.key_probe import key_probe
    from transmla.eval.passkey import PasskeySettings
    from transmla.eval.perplexity import perplexity

    from .calib_mix import eval_text_spec

    out: dict = {"perplexity": {}}
    start = time.perf_counter()
    with torch.no_grad():
        for text in target.texts:
            ids = tokenize_text(tok, load_text(eval_text_spec(text), "eval"))
            out["perplexity"][text] = perplexity(model, ids, seq_len=SEQ, max_windows=target.windows,
                                                 progress=False).perplexity
            log(f"{text}: {out['perplexity'][text]:.3f}")
            save(out)
        if target.tasks:
            probe = key_probe(model, tok, PasskeySettings(**PROBE), PROBE_LENGTHS)
            out["keys"] = {k: probe[k] for k in ("nll", "exact", "keys")}
            recall = score_items(model, recall_items(tok, ChoiceSettings(**RECALL)))
            out["recall"] = {k: recall[k] for k in ("items", "acc", "nll")}
    out["eval_seconds"] = round(time.perf_counter() - start, 1)
    return out


def run(name: str, target: Target, care: Path | None, samples: int, cache: ResultCache) -> None:
    from transmla.checkpoint.resolve import load_model, resolve_model_dir

    env = machine()
    source_dir = resolve_model_dir(target.model)
    row: dict = {"machine": env}
    if name == "source":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(source_dir, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(source_dir)
        row |= {"fraction": 1.0, "shape": "source"}
    elif name in target.cli_runs:
        fraction, folder = target.cli_runs[name]
        model, tok = load_model(ROOT / folder)
        row |= {"fraction": fraction, "shape": cli_shape(folder), "folder": folder}
    else:
        if care is None:
            raise SystemExit(f"{name}: give --care DIR (a checkout of FutureMLS-Lab/CARE)")
        fraction, rank, mqa = target.care_runs[name]
        start = time.perf_counter()
        model, tok = care_model(care / "src", source_dir, rank, mqa, samples)
        row |= {"fraction": fraction, "shape": f"{rank} + {mqa}", "convert_seconds": round(time.perf_counter() - start, 1),
                "care": {"commit": CARE_COMMIT, "kv_lora_rank": rank, "qk_mqa_dim": mqa, "freqfold": FREQFOLD,
                         "damping": DAMPING, "samples": samples, "seq": CAL_SEQ, "method": "care", "dtype": "fp32"}}
    def save(partial: dict) -> None:
        cache.results[name] = row | partial | {"partial": True, "load_after": round(os.getloadavg()[0], 2)}
        cache.save()

    row |= measure(model, tok, target, save)
    row["load_after"] = round(os.getloadavg()[0], 2)
    row["date"] = time.strftime("%Y-%m-%d %H:%M")
    cache.results[name] = row
    cache.save()
    log(f"{name}: {row['perplexity']} keys {row.get('keys')} recall {row.get('recall')}")


def screen(target: Target, care: Path, shapes: list[tuple[int, int]], samples: int, windows: int,
           cache: ResultCache) -> None:
    """CARE at each (kv_lora_rank, qk_mqa_dim) with `samples` calibration sequences, and the source: wiki perplexity
    on the first `windows` windows (a quick look at which shapes CARE's code converts sanely)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from transmla.checkpoint.resolve import resolve_model_dir
    from transmla.data.calib import tokenize_text
    from transmla.data.texts import load_text
    from transmla.eval.perplexity import perplexity

    source_dir = resolve_model_dir(target.model)
    rows = cache.results.setdefault("screen", {})

    def wiki(model, tok) -> float:
        with torch.no_grad():
            ids = tokenize_text(tok, load_text("wiki", "eval"))
            return perplexity(model, ids, seq_len=SEQ, max_windows=windows, progress=False).perplexity

    key = f"source x{windows}"
    if key not in rows:
        rows[key] = {"wiki": wiki(AutoModelForCausalLM.from_pretrained(source_dir, dtype=torch.float32).eval(),
                                  AutoTokenizer.from_pretrained(source_dir)), "machine": machine()}
        cache.save()
    for rank, mqa in shapes:
        key = f"{rank} + {mqa}, {samples} samples x{windows}"
        if key in rows:
            continue
        start = time.perf_counter()
        model, tok = care_model(care / "src", source_dir, rank, mqa, samples)
        rows[key] = {"rank": rank, "qk_mqa_dim": mqa, "samples": samples, "windows": windows, "wiki": wiki(model, tok),
                     "seconds": round(time.perf_counter() - start, 1), "machine": machine()}
        cache.save()
        log(f"CARE {key}: wiki {rows[key]['wiki']:.2f}")


def referenced(target: Target) -> dict:
    """The source's and the CLI's rows of target.reference's JSON, in this table's form."""
    if target.reference is None:
        return {}
    stem, keys = target.reference
    other = ResultCache(RESULTS / f"{stem}.json").results
    rows = {}
    for name, key in keys.items():
        r = other.get(key)
        if r is None:
            continue
        fraction, folder = (1.0, None) if name == "source" else target.cli_runs[name]
        shape = "source" if name == "source" else f"{r['mla']['kv_lora_rank']} + {r['mla']['qk_rope_head_dim']} (CLI)"
        rows[name] = {"fraction": fraction, "shape": shape, "machine": r["machine"], "load_after": "?",
                      "perplexity": {t: r[t]["perplexity"] for t in target.texts},
                      "from": f"benchmarks/results/{stem}.json, {key}"}
        if r.get("conversion"):
            rows[name]["convert_seconds"] = r["conversion"].get("wall_s")
    return rows


def cli_shape(folder: str) -> str:
    """'latent + rope (CLI)' of a CLI conversion's folder."""
    mla = json.loads((ROOT / folder / "config.json").read_text())["mla"]
    return f"{mla['kv_lora_rank']} + {mla['qk_rope_head_dim']} (CLI)"


def report(results: dict, target: Target) -> str:
    results = {**referenced(target), **results}
    src = results.get("source")
    tasks = target.tasks
    intro = (f"Made by `python -m benchmarks.care_peer --model {target.model}` (protocol and CARE's settings in its "
             f"docstring). Perplexity on the first {target.windows} windows of {SEQ} tokens of each evaluation part "
             "(x: over the source's)")
    if tasks:
        intro += ("; keys: the passkey likelihood probe (test seed 0, 1K/2K/4K, depths 10/50/90, 5 keys: mean key NLL "
                  "/ exact of 45); recall: 60 items (seed 0), accuracy / nll (chance 25%)")
    intro += (". CARE calibrates on the wiki text only (its own default is wikitext2); the CLI's default calibration "
              "mixes wiki, lee and code (3 : 1 : 2), which is part of the gap on code.")
    if target.reference:
        intro += (f" The source's and the CLI's rows are benchmarks/results/{target.reference[0]}.json's (the same "
                  "windows and scoring code), not measured again; the CLI's conversion seconds there are its wall time "
                  "under /usr/bin/time.")
    head = ["run", "cache", "latent + rope", *target.texts, *(["keys", "recall"] if tasks else []), "convert s", "CPU, load"]
    lines = [f"# CARE (its own code) beside the CLI on {target.model}, the same cache per token", "", intro, "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    runs = {**target.cli_runs, **target.care_runs}
    order = ["source", *[n for f in sorted({v[0] for v in runs.values()}, reverse=True) for n in runs if runs[n][0] == f]]
    for name in order:
        r = results.get(name)
        if r is None:
            continue
        ppl = r["perplexity"]
        cells = [("not measured" if t not in ppl else f"{ppl[t]:.2f}" + (
                     f" ({ppl[t] / src['perplexity'][t]:.2f}x)" if src and name != "source" else "")) for t in target.texts]
        if tasks:
            keys, rec = r.get("keys"), r.get("recall")
            cells += [f"{keys['nll']:.3f} / {keys['exact']}" if keys else "not measured",
                      f"{rec['acc']:.0%} / {rec['nll']:.3f}" if rec else "not measured"]
        env = r["machine"]
        lines.append(f"| {name} | {r['fraction']:.0%} | {r['shape']} | {' | '.join(cells)} | {r.get('convert_seconds', '-')} | "
                     f"{env['machine']}, {env['threads']} thread(s), load {env['load_average']}-{r['load_after']} |")
    stopped = [n for n in order if results.get(n, {}).get("partial")]
    if stopped:
        lines += ["", "Stopped before every text was measured: " + "; ".join(
            n + (f" ({results[n]['note']})" if results[n].get("note") else "") for n in stopped) + "."]
    rows = results.get("screen")
    if rows:
        src_keys = {k.split(" x")[1]: v["wiki"] for k, v in rows.items() if k.startswith("source")}
        lines += ["", "Screen (`--screen`): CARE with few calibration sequences at several shapes, wiki perplexity on the "
                  "first windows (x: over the source's on the same windows); CARE's own script for this model family "
                  "keeps 256 + 64.", "", "| CARE shape (latent + rope) | cache | samples | windows | wiki | seconds |",
                  "|---|---|---|---|---|---|"]
        for k, v in rows.items():
            if k.startswith("source"):
                continue
            ref = src_keys.get(str(v["windows"]))
            ratio = f" ({v['wiki'] / ref:.2f}x)" if ref else ""
            lines.append(f"| {v['rank']} + {v['qk_mqa_dim']} | {(v['rank'] + v['qk_mqa_dim']) / target_elements(target):.1%} | "
                         f"{v['samples']} | {v['windows']} | {v['wiki']:.2f}{ratio} | {v['seconds']} |")
        lines += ["", "Source on the same windows: " + ", ".join(f"{w} windows {p:.2f}" for w, p in src_keys.items()) + "."]
    return "\n".join(lines) + "\n"


def target_elements(target: Target) -> int:
    """The source's cached elements per token per layer."""
    from transmla.checkpoint.resolve import resolve_model_dir
    from transmla.families import attention_geometry
    from transformers import AutoConfig

    return attention_geometry(AutoConfig.from_pretrained(resolve_model_dir(target.model))).kv_elements_per_token_per_layer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", choices=list(TARGETS), help="the source model")
    parser.add_argument("--runs", help="comma-separated runs (default: every run of --model not yet measured)")
    parser.add_argument("--care", type=Path, help="a checkout of FutureMLS-Lab/CARE (its src is imported)")
    parser.add_argument("--samples", type=int, default=128, help="CARE's calibration sequences of 256 tokens")
    parser.add_argument("--screen", help="CARE shapes to screen instead of the runs, e.g. 256+64,96+32 (with --samples)")
    parser.add_argument("--screen-windows", type=int, default=2, help="wiki windows of the screen")
    parser.add_argument("--report", action="store_true", help="only rewrite the table")
    args = parser.parse_args()
    target = TARGETS[args.model]
    runs = [*([] if target.reference else ["source"]), *[n for n in target.cli_runs if not target.reference],
            *target.care_runs]
    cache = ResultCache(RESULTS / f"{target.stem}.json")
    if args.screen and not args.report:
        if args.care is None:
            parser.error("--screen needs --care DIR")
        shapes = [tuple(int(v) for v in shape.split("+")) for shape in args.screen.split(",")]
        screen(target, args.care, shapes, args.samples, args.screen_windows, cache)
    elif not args.report:
        for name in [n for n in (args.runs or ",".join(runs)).split(",") if n]:
            if name not in runs:
                parser.error(f"unknown run {name} for {target.model}; choose from {', '.join(runs)}")
            if name not in cache.results or cache.results[name].get("partial"):
                run(name, target, args.care, args.samples, cache)
    (RESULTS / f"{target.stem}.md").write_text(report(cache.results, target))


if __name__ == "__main__":
    main()
