"""Calibration mixes on text unlike the calibration text (issue 18): a first measurement.

    .venv/bin/python -m benchmarks.calib_mix                 # every mix not yet in the JSON, then the report
    .venv/bin/python -m benchmarks.calib_mix --report        # only rewrite the table

The built-in SmolLM2-135M converted with TransMLA at 25% of the cache and the CLI defaults in the native
shape, once per calibration mix (`transmla convert smollm2-135m OUT --method transmla --kv-budget 0.25
--per-layer-rope --calib MIX`),
each evaluated with `transmla eval OUT --data PATH --max-windows 16 --json` (512-token windows) on two
held-out domains that no mix calibrates on, written once into $TRANSMLA_CACHE/bench-calib-mix:
- code: Python source of this interpreter's standard library (the modules whose names start with
  n..z, sorted, joined), the skill a coder model exists for;
- licences: Debian's licence texts (/usr/share/common-licenses, sorted, joined), legal English.
A mix may name {code_calib}: the other half of the standard library (modules a..m), disjoint from
the code that is evaluated.
The source model is evaluated on the same windows. No wiki or lee test windows are used here.

The first rows were made before the output-aware fit existed (`--fit-steps 0` reproduces them); the
rows marked fit-100 convert with the fit (100 steps, its first default), and add lee-dev (the first 16 windows of
lee's calibration part; no mix here calibrates on lee, so the two dev texts make dev32, the dev set of
benchmarks/smollm2.py). The rule to choose the default mix among the fit-100 rows, written before
they were measured: a mix replaces wiki alone only if its dev32 (pooled wiki-dev + lee-dev) is at
most 5% higher and it lowers both held-out domains' perplexity by more than that. When code is in the
mix, the code column is no longer a domain nobody calibrated on (other modules of the same library);
licences stay held out.

The fit-200 round (200 steps, the CLI default since) names the built-in text `code` (transmla's
`--calib code`: the same modules a..m; the held-out code is its evaluation part, modules n..z) and adds
lee to a mix, which the issue asks for. Its rule, written before the round was measured: among the
fit-200 rows, a mix replaces wiki alone as the default only if its dev32 is at most 5% above wiki's and
its licence perplexity (the one domain no candidate calibrates on) is more than 5% below wiki's; of the
mixes that pass, the one with the lowest licence perplexity wins; ties within 1% go to the smaller mix.
Outcome: both mixes pass; wiki=3,code=1 has the lower licence perplexity (56.89 against 58.13, 2% apart)
and is the CLI default since (transmla.convert.options.DEFAULT_CALIB). The lee mix's lower dev32 (44.22
against 50.58) comes from lee-dev, which its calibration now covers. These rows ran the fit in fp32
(the CLI has run Adam under bf16 autocast on bf16-native hardware since; on dev32 the two tie).

The lee round (rows keyed `... + fit-200 bf16`, the fit as the CLI runs it today: 200 steps, Adam
under bf16 autocast) asks whether news text belongs in the default too: lee-test misses the issue's
goals with wiki=3,code=1. The candidate names {lee_calib}: lee's calibration part without its first
16 x 512 tokens, i.e. without the lee-dev windows (cut at the character where token 8192 ends), so dev32
stays text the candidate never calibrated on; the CLI default would name `lee` (the whole part). The
default is re-run beside it under the same bf16 fit. Rule, written before the round was measured: the
candidate replaces wiki=3,code=1 only if its dev32 is more than 3% lower and neither held-out domain
(licences, code n..z) rises by more than 3%.
Outcome: rejected. Its dev32 is 10.8% lower (45.33 against 50.84: lee-dev 51.68 against 65.79,
wiki-dev 39.77 against 39.29) and the licences rise 1.8% (58.13 against 57.12), but held-out code rises
6.2% (22.16 against 20.86). wiki=3,code=1 stays the default.

The lee round, second candidate (session of 2026-11-25, 09:30): the rejected mix lost held-out code
because code's share fell from 1/4 to 1/5; wiki=3,{lee_calib}=1,code=2 gives code 1/3 and lee 1/6.
Same rule as above, written before it was measured: it replaces wiki=3,code=1 only if its dev32 is more
than 3% lower and neither held-out domain (licences, code n..z) rises by more than 3%. A second
candidate tried after a rejection is a second look at the same dev windows; the rule's margins stay.
Outcome: accepted. dev32 46.56 against 50.84 (-8.4%; lee-dev 53.36 against 65.79, wiki-dev 40.62 against
39.29, +3.4%), held-out code 19.13 against 20.86 (-8.3%), licences 54.02 against 57.12 (-5.4%). The CLI
default is `wiki=3,lee=1,code=2` since (it names `lee`, the whole calibration part; the dev32 of a
conversion with the default then includes lee-dev text it calibrated on).

The rope split round at 50% (session of 2026-11-25, 12:10; rows keyed `... | export 50% r=R`): lee-test misses
the issue's 50% goal by 0.1% (1.151x against 1.15x), and the budget's split into latent and rope dims
(a third as rope dims, the published rule: 128 + 64 at 50%) was never measured. Both rows convert at 50%
in the exportable shape (`--shared-rope`) with the bf16 fit and wiki=3,{lee_calib}=1,code=2 (the default
mix without lee-dev, so dev32 stays uncalibrated text); r=64 is today's split, r=32 gives the latent
160. Rule, written before the round was measured: rope dims capped at head_dim / 2 (r=32 here; the
split changes only where a third of the budget exceeds that, i.e. above 25% on SmolLM2) becomes the
default only if its dev32 is more than 1% lower than r=64's and neither held-out domain (licences,
code n..z) rises by more than 3%.
Outcome: accepted, by a small margin. dev32 27.71 against 27.99 (-1.03%; wiki-dev 23.20 against 23.30,
lee-dev 33.09 against 33.63), held-out code 11.16 against 11.30 (-1.2%), licences 22.78 against 22.94
(-0.7%). transmla.convert.transmla.budget caps the rope dims at half a head since (DeepSeek-V2/V3's 64
of 128), for the native shapes as well.

Writes benchmarks/results/calib_mix.json (resumable) and calib_mix.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from transmla.checkpoint.resolve import cache_root

from .common import RESULTS, ResultCache, log, machine, transmla_json

SOURCE = "smollm2-135m"
MIXES = ("wiki", "wiki=1,lee=1", "wiki=1,{code_calib}=1")  # {code_calib}: stdlib modules a..m
FIT_STEPS = 100  # the fit-100 rows (the fit's first default; the CLI now runs 200)
FIT_MIXES = ("wiki", "wiki=1,{code_calib}=1", "wiki=3,{code_calib}=1")
FIT200_MIXES = ("wiki", "wiki=3,code=1", "wiki=3,lee=1,code=1")  # the fit-200 round (docstring)
LEE_MIXES = ("wiki=3,code=1", "wiki=3,{lee_calib}=1,code=1", "wiki=3,{lee_calib}=1,code=2")  # the lee round, bf16 fit (docstring)
SPLIT_MIX = "wiki=3,{lee_calib}=1,code=2"  # the rope split round (docstring): 50%, exportable, bf16 fit
SPLIT_ROPE_DIMS = (64, 32)  # today's split (128 + 64), then the latent 160 + rope 32
SPLIT_CACHE = 192  # 50% of SmolLM2's 384 cached elements per token per layer: latent + rope dims
WINDOWS = 16
SEQ = 512
WORK = cache_root() / "bench-calib-mix"
OUT_JSON = RESULTS / "calib_mix.json"
OUT_MD = RESULTS / "calib_mix.md"


def eval_text_spec(text: str) -> str:
    """What `transmla eval --data` (and load_text) reads for a text of the 1.5B's tables: a built-in name as it is,
    `licences` as the Debian licence texts' file."""
    return str(held_out_texts()["licences"]) if text == "licences" else text


def held_out_texts() -> dict[str, Path]:
    """The held-out domains, {code_calib} and {lee_calib} as text files (written once): the built-in
    `code` text's two parts (stdlib modules n..z and a..m), Debian's licence texts and lee's
    calibration part without the lee-dev windows."""
    from transmla.data.texts import builtin_text

    WORK.mkdir(parents=True, exist_ok=True)
    licences = sorted(p for p in Path("/usr/share/common-licenses").iterdir() if p.is_file())
    texts = {
        "code": lambda: builtin_text("code", "eval"),
        "code_calib": lambda: builtin_text("code", "calib"),
        "licences": lambda: "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in licences),
        "lee_calib": lee_without_dev,
    }
    out = {}
    for name, text in texts.items():
        path = WORK / f"{name}.txt"
        if not path.exists():
            path.write_text(text(), encoding="utf-8")
        out[name] = path
    return out


def lee_without_dev() -> str:
    """Lee's calibration part from the character where its lee-dev windows (the first WINDOWS x SEQ
    tokens under the source's tokenizer) end."""
    from transformers import AutoTokenizer

    from transmla.checkpoint.resolve import resolve_model_dir
    from transmla.data.texts import builtin_text

    text = builtin_text("lee", "calib")
    tok = AutoTokenizer.from_pretrained(resolve_model_dir(SOURCE))
    offsets = tok(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)["offset_mapping"]
    return text[offsets[WINDOWS * SEQ - 1][1]:]


def dev_windows(model: str) -> dict[str, float]:
    """Perplexity on the dev windows: the last 16 windows of wiki's calibration part (the dev protocol
    of benchmarks/smollm2.py; the CLI calibration samples that part) and the first 16 of lee's."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import transmla  # noqa: F401  (registers the MLA models)
    from transmla.checkpoint.resolve import resolve_model_dir
    from transmla.data.calib import tokenize_text
    from transmla.data.texts import load_text

    from .smollm2 import dev32_ppl

    folder = resolve_model_dir(model)
    tok = AutoTokenizer.from_pretrained(folder)
    wiki = tokenize_text(tok, load_text("wiki", "calib"))[-WINDOWS * SEQ :]
    lee = tokenize_text(tok, load_text("lee", "calib"))[: WINDOWS * SEQ]
    m = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    res = dev32_ppl(m, {"wiki": wiki, "lee": lee})
    return {"wiki": res["wiki"], "lee": res["lee"], "dev32": res["ppl"]}


def key_of(mix: str, fit_steps: int, bf16: bool = False, rope_dim: int | None = None) -> str:
    key = mix if fit_steps == 0 else f"{mix} + fit-{fit_steps}" + (" bf16" if bf16 else "")
    return key if rope_dim is None else f"{key} | export 50% r={rope_dim}"


def fit_bf16(model: str) -> bool | None:
    """Whether the conversion in `model` ran its fit under bf16 autocast (its record), None for the source."""
    import json

    config = Path(model) / "config.json"
    if not config.is_file():
        return None
    fit = json.loads(config.read_text())["mla"]["method"]["calibration"].get("fit") or {}
    return fit.get("bf16")


def run(mix: str | None, texts: dict[str, Path], fit_steps: int = 0, rope_dim: int | None = None) -> dict:
    """Perplexity of the source (mix None) or of the conversion calibrated on `mix`: at 25%, or with
    `rope_dim` at 50% in the exportable shape with that split (latent = SPLIT_CACHE - rope_dim)."""
    model = SOURCE
    if mix is not None:
        index = list(dict.fromkeys(MIXES + FIT_MIXES + FIT200_MIXES + LEE_MIXES)).index(mix)
        shape = ["--kv-budget", "0.25", "--per-layer-rope"]  # the native shape of the 25% rows
        if rope_dim is None:
            model = str(WORK / f"transmla-25-mix{index}-fit{fit_steps}")
        else:
            model = str(WORK / f"transmla-export-50-r{rope_dim}-mix{index}-fit{fit_steps}")
            shape = ["--kv-lora-rank", str(SPLIT_CACHE - rope_dim), "--rope-dim", str(rope_dim), "--shared-rope"]
        calib = mix.format(code_calib=texts["code_calib"], lee_calib=texts["lee_calib"])
        log(f"converting with --calib {calib} --fit-steps {fit_steps} {' '.join(shape)}")
        transmla_json("convert", SOURCE, model, "--method", "transmla", *shape, "--calib", calib,
                      "--fit-steps", str(fit_steps), "--force")
    dev = dev_windows(model)
    entry = {"mix": mix, "fit_steps": fit_steps, "rope_dim": rope_dim, "machine": machine(), "fit_bf16": fit_bf16(model),
             "wiki_dev": {"perplexity": dev["wiki"], "windows": WINDOWS},
             "lee_dev": {"perplexity": dev["lee"], "windows": WINDOWS}, "dev32": {"perplexity": dev["dev32"]}}
    log(f"{mix or 'source'} on dev32: {dev['dev32']:.3f} (wiki {dev['wiki']:.3f}, lee {dev['lee']:.3f})")
    for name in ("code", "licences"):
        r = transmla_json("eval", model, "--data", str(texts[name]), "--max-windows", str(WINDOWS))
        entry[name] = {"perplexity": r["perplexity"], "windows": r["windows"], "tokens": r["tokens"]}
        log(f"{mix or 'source'} on {name}: {r['perplexity']:.3f}")
    return entry


def report(results: dict) -> str:
    src = results.get("source")
    lines = ["# Calibration mixes on held-out domains: SmolLM2-135M, TransMLA at 25% (and a rope split round at 50%)", "",
             "Made by `python -m benchmarks.calib_mix` (protocol and the rule that chooses the default in its "
             "docstring): 16 windows of 512 tokens of Python standard-library source (modules n..z) and of "
             "Debian's licence texts, neither calibrated on ({code_calib} = the library's modules a..m); "
             "wiki-dev: the last 16 windows of wiki's calibration part (the dev protocol of "
             "benchmarks/smollm2.py; calibration samples that part); lee-dev: the first 16 of lee's; dev32 "
             "pools the two. Fit: the output-aware fit's Adam steps (0: the rows made before it existed; bf16: under "
             "bf16 autocast, as the CLI runs it today). {lee_calib}: lee's calibration part without lee-dev.", "",
             "| model | --calib | fit | dev32 | wiki-dev | x source | lee-dev | x source | code | x source | "
             "licences | x source |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, e in results.items():
        cells = [f"{e['dev32']['perplexity']:.3f}" if "dev32" in e else "-"]
        for name in ("wiki_dev", "lee_dev", "code", "licences"):
            if name not in e:
                cells += ["-", "-"]
                continue
            ppl = e[name]["perplexity"]
            cells += [f"{ppl:.3f}", f"{ppl / src[name]['perplexity']:.2f}" if src and name in src else ""]
        model = "source" if e["mix"] is None else "TransMLA 25%" if e.get("rope_dim") is None else \
            f"TransMLA 50% export, {SPLIT_CACHE - e['rope_dim']} + {e['rope_dim']}"
        fit = "" if e["mix"] is None else str(e.get("fit_steps", 0)) + (" bf16" if e.get("fit_bf16") else "")
        lines.append(f"| {model} | {e['mix'] or ''} | {fit} | {' | '.join(cells)} |")
    m = (src or {}).get("machine", {})
    lines += ["", f"Machine: {m.get('machine')}, torch {m.get('torch')}, transformers {m.get('transformers')}.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--report", action="store_true", help="only rewrite the Markdown table")
    ap.add_argument("--only", help="semicolon-separated row keys to run (e.g. 'wiki + fit-200'); others are left alone")
    args = ap.parse_args(argv)
    only = None if args.only is None else {k.strip() for k in args.only.split(";")}
    results = ResultCache(OUT_JSON)
    if not args.report:
        texts = held_out_texts()
        if "lee_dev" not in results.results.get("source", {}):  # lee-dev came with the fit-100 rows
            results.results.pop("source", None)
        rows = [(None, 0, False, None)] + [(m, 0, False, None) for m in MIXES]
        rows += [(m, FIT_STEPS, False, None) for m in FIT_MIXES] + [(m, 200, False, None) for m in FIT200_MIXES]
        rows += [(m, 200, True, None) for m in LEE_MIXES]
        rows += [(SPLIT_MIX, 200, True, r) for r in SPLIT_ROPE_DIMS]
        for mix, steps, bf16, rope_dim in rows:
            key = "source" if mix is None else key_of(mix, steps, bf16, rope_dim)
            if only is None or key in only:
                results.cached(key, lambda mix=mix, steps=steps, rope_dim=rope_dim: run(mix, texts, steps, rope_dim))
    OUT_MD.write_text(report(results.results))
    print(OUT_MD.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
