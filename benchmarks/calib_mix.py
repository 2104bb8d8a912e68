"""Calibration mixes on text unlike the calibration text (issue 18): a first measurement.

    .venv/bin/python -m benchmarks.calib_mix                 # every mix not yet in the JSON, then the report
    .venv/bin/python -m benchmarks.calib_mix --report        # only rewrite the table

The built-in SmolLM2-135M converted with TransMLA at 25% of the cache and the CLI defaults, once per
calibration mix (`transmla convert smollm2-135m OUT --method transmla --kv-budget 0.25 --calib MIX`),
each evaluated with `transmla eval OUT --data PATH --max-windows 16 --json` (512-token windows) on two
held-out domains that no mix calibrates on, written once into $TRANSMLA_CACHE/bench-calib-mix:
- code: Python source of this interpreter's standard library (the modules whose names start with
  n..z, sorted, joined), the skill a coder model exists for;
- licences: Debian's licence texts (/usr/share/common-licenses, sorted, joined), legal English.
A mix may name {code_calib}: the other half of the standard library (modules a..m), disjoint from
the code that is evaluated.
The source model is evaluated on the same windows. No wiki or lee test windows are used here: this
measures how far each mix carries to other domains, it chooses nothing (defaults are chosen on dev
windows, issue 18).

Writes benchmarks/results/calib_mix.json (resumable) and calib_mix.md.
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from pathlib import Path

from transmla.checkpoint.resolve import cache_root

from .common import RESULTS, ResultCache, log, machine, transmla_json

SOURCE = "smollm2-135m"
MIXES = ("wiki", "wiki=1,lee=1", "wiki=1,{code_calib}=1")  # {code_calib}: stdlib modules a..m
WINDOWS = 16
SEQ = 512
WORK = cache_root() / "bench-calib-mix"
OUT_JSON = RESULTS / "calib_mix.json"
OUT_MD = RESULTS / "calib_mix.md"


def held_out_texts() -> dict[str, Path]:
    """The two held-out domains as text files (written once)."""
    WORK.mkdir(parents=True, exist_ok=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = {
        "code": sorted(p for p in stdlib.glob("*.py") if p.name[0] >= "n"),
        "code_calib": sorted(p for p in stdlib.glob("*.py") if p.name[0] < "n"),
        "licences": sorted(p for p in Path("/usr/share/common-licenses").iterdir() if p.is_file()),
    }
    out = {}
    for name, files in sources.items():
        path = WORK / f"{name}.txt"
        if not path.exists():
            path.write_text("\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files), encoding="utf-8")
        out[name] = path
    return out


def wiki_dev(model: str) -> float:
    """Perplexity on the dev windows of the calibration domain: the last 16 windows of wiki's
    calibration part (the dev protocol of benchmarks/smollm2.py; never a test window)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import transmla  # noqa: F401  (registers the MLA models)
    from transmla.checkpoint.resolve import resolve_model_dir
    from transmla.data.calib import tokenize_text
    from transmla.data.texts import load_text
    from transmla.eval.perplexity import perplexity

    folder = resolve_model_dir(model)
    ids = tokenize_text(AutoTokenizer.from_pretrained(folder), load_text("wiki", "calib"))[-WINDOWS * SEQ :]
    m = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return perplexity(m, ids, SEQ, progress=False).perplexity


def run(mix: str | None, texts: dict[str, Path]) -> dict:
    """Perplexity of the source (mix None) or of the 25% conversion calibrated on `mix`."""
    model = SOURCE
    if mix is not None:
        model = str(WORK / f"transmla-25-mix{MIXES.index(mix)}")
        calib = mix.format(code_calib=texts["code_calib"])
        log(f"converting with --calib {calib}")
        transmla_json("convert", SOURCE, model, "--method", "transmla", "--kv-budget", "0.25", "--calib", calib, "--force")
    entry = {"mix": mix, "machine": machine(), "wiki_dev": {"perplexity": wiki_dev(model), "windows": WINDOWS}}
    log(f"{mix or 'source'} on wiki-dev: {entry['wiki_dev']['perplexity']:.3f}")
    for name in ("code", "licences"):
        r = transmla_json("eval", model, "--data", str(texts[name]), "--max-windows", str(WINDOWS))
        entry[name] = {"perplexity": r["perplexity"], "windows": r["windows"], "tokens": r["tokens"]}
        log(f"{mix or 'source'} on {name}: {r['perplexity']:.3f}")
    return entry


def report(results: dict) -> str:
    src = results.get("source")
    lines = ["# Calibration mixes on held-out domains: SmolLM2-135M, TransMLA at 25%", "",
             "Made by `python -m benchmarks.calib_mix` (protocol in its docstring): 16 windows of 512 tokens of "
             "Python standard-library source (modules n..z) and of Debian's licence texts, neither calibrated on "
             "({code_calib} = the library's modules a..m); wiki-dev: the last 16 windows of wiki's calibration part "
             "(the dev protocol of benchmarks/smollm2.py; calibration samples that part).", "",
             "| model | --calib | wiki-dev | x source | code | x source | licences | x source |",
             "|---|---|---|---|---|---|---|---|"]
    for key, e in results.items():
        cells = []
        for name in ("wiki_dev", "code", "licences"):
            ppl = e[name]["perplexity"]
            cells += [f"{ppl:.3f}", f"{ppl / src[name]['perplexity']:.2f}" if src else ""]
        lines.append(f"| {'source' if e['mix'] is None else 'TransMLA 25%'} | {e['mix'] or ''} | {' | '.join(cells)} |")
    m = (src or {}).get("machine", {})
    lines += ["", f"Machine: {m.get('machine')}, torch {m.get('torch')}, transformers {m.get('transformers')}.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--report", action="store_true", help="only rewrite the Markdown table")
    args = ap.parse_args(argv)
    results = ResultCache(OUT_JSON)
    if not args.report:
        texts = held_out_texts()
        results.cached("source", lambda: run(None, texts))
        for mix in MIXES:
            results.cached(mix, lambda mix=mix: run(mix, texts))
    OUT_MD.write_text(report(results.results))
    print(OUT_MD.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
