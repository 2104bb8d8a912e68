"""The strongest training-free peer, CARE (FutureMLS-Lab/CARE, ICLR 2026), run with its own code on our
models and texts beside the CLI's conversions at the same cache per token (issue 36).

    .venv/bin/python -m benchmarks.care_peer --care DIR                    # SmolLM2 at 50% and 25%
    .venv/bin/python -m benchmarks.care_peer --care DIR --runs care-0.25   # some runs
    .venv/bin/python -m benchmarks.care_peer --report                      # only the table

DIR is a checkout of FutureMLS-Lab/CARE (commit c3c2126; never copied into this repository); its `src` is
imported as is, but for its one data container: its utils import `datasets` (Hugging Face's) for
Dataset.from_dict / filter / set_transform around a list of strings, and datasets 5.2 with pyarrow 26 cannot
even build a Dataset here (its fingerprint pickling fails on pyarrow's MonthDayNano); a stand-in with those four
operations (_Rows below, the same row order, filtering and per-batch transform) takes its place.

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

Writes benchmarks/results/care_peer_smollm2.json and .md, with the CPU and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from .common import RESULTS, ResultCache, log, machine

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m"
STEM = "care_peer_smollm2"
CARE_COMMIT = "c3c2126"
TEXTS = ("wiki", "lee", "code")
SEQ, WINDOWS = 512, 32
PROBE = dict(depths="10,50,90", keys=5, seed=0)
PROBE_LENGTHS = [1024, 2048, 4096]
RECALL = dict(items=60, context_tokens=1024, task_seed=0)
# run -> (fraction of the source's cache, CARE's kv_lora_rank, qk_mqa_dim): SmolLM2 keeps 3 x 64 x 2 = 384
# elements per token per layer; the CLI's exportable shapes at 50% and 25% are 128 + 64 and 64 + 32.
CARE_RUNS = {"care-0.5": (0.5, 128, 64), "care-0.25": (0.25, 64, 32)}
# run -> the CLI's conversion at that budget (benchmarks/passkey's folders, under the repository root)
CLI_RUNS = {"transmla-0.5": (0.5, "out/passkey/transmla-50-shared"), "transmla-0.25": (0.25, "out/passkey/transmla-25-shared")}
FREQFOLD, DAMPING, CAL_SEQ, CAL_BATCH, SEED = 4, 0.01, 256, 2, 42


class _Rows:
    """What CARE's prepare_dataloader uses of a datasets.Dataset: from_dict, column_names, filter (a row
    predicate), column access, set_transform (a batch transform), and the rows a DataLoader fetches."""

    def __init__(self, columns: dict[str, list]) -> None:
        self._columns, self._transform = columns, None

    @classmethod
    def from_dict(cls, columns: dict[str, list]) -> "_Rows":
        return cls({k: list(v) for k, v in columns.items()})

    @property
    def column_names(self) -> list[str]:
        return list(self._columns)

    def __len__(self) -> int:
        return len(next(iter(self._columns.values())))

    def filter(self, keep) -> "_Rows":
        rows = [i for i in range(len(self)) if keep({k: v[i] for k, v in self._columns.items()})]
        return _Rows({k: [v[i] for i in rows] for k, v in self._columns.items()})

    def set_transform(self, transform) -> None:
        self._transform = transform

    def __getitem__(self, key):
        if isinstance(key, str):
            return self._columns[key]
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list[int]) -> list[dict]:
        # as datasets does: the transform on the batch, then one dict per row (the DataLoader collates them)
        batch = {k: [v[i] for i in keys] for k, v in self._columns.items()}
        batch = self._transform(batch) if self._transform else batch
        return [{k: v[i] for k, v in batch.items()} for i in range(len(keys))]


def _datasets_stand_in() -> None:
    """`import datasets` in CARE's utils finds _Rows (it only names the module's types otherwise)."""
    import types

    module = types.ModuleType("datasets")
    module.Dataset, module.DatasetDict = _Rows, dict
    sys.modules["datasets"] = module


def care_model(care_src: Path, source_dir: Path, kv_lora_rank: int, qk_mqa_dim: int, samples: int):
    """CARE's conversion of the source, in memory: its partial_rope then its low_rank_qkv (method care)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from transmla.data.texts import load_text

    _datasets_stand_in()
    sys.path.insert(0, str(care_src))
    from cli.convert import parse_args  # CARE's own CLI, for its defaults
    from lora_qkv import low_rank_qkv
    from partial_rope import partial_rope
    from utils import prepare_dataloader

    model = AutoModelForCausalLM.from_pretrained(source_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    tok = AutoTokenizer.from_pretrained(source_dir)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    head_dim = model.config.head_dim or model.config.hidden_size // model.config.num_attention_heads
    args = parse_args(["--model-path", str(source_dir), "--save-path", "-", "--dtype", "fp32", "--kv-lora-rank",
                       str(kv_lora_rank), "--qk-mqa-dim", str(qk_mqa_dim), "--collapse", str(head_dim // qk_mqa_dim),
                       "--freqfold", str(FREQFOLD), "--kv-decomp-method", "care", "--cwsvd-percdamp", str(DAMPING),
                       "--cal-max-seqlen", str(CAL_SEQ), "--cal-batch-size", str(CAL_BATCH), "--cal-nsamples",
                       str(samples), "--seed", str(SEED), "--ppl-eval-batch-size", "0"])
    kwargs = vars(args) | {"collapse": int(args.collapse)}
    paragraphs = [p for p in load_text("wiki", "calib").split("\n\n") if p.strip()]
    train = prepare_dataloader(dataset=_Rows.from_dict({"text": paragraphs}), tokenizer=tok,
                               max_seqlen=CAL_SEQ, batch_size=CAL_BATCH, nsamples=samples, seed=SEED)
    with torch.no_grad():
        model = partial_rope(model, tok, train, None, **kwargs)
        model = low_rank_qkv(model, tok, train, None, **kwargs)
    return model.eval(), tok


def measure(model, tok) -> dict:
    """Test perplexity on each text, the key probe and the recall task."""
    from transmla.data.calib import tokenize_text
    from transmla.data.texts import load_text
    from transmla.eval.choice_tasks import ChoiceSettings, recall_items, score_items
    from transmla.eval.key_probe import key_probe
    from transmla.eval.passkey import PasskeySettings
    from transmla.eval.perplexity import perplexity

    out: dict = {"perplexity": {}}
    start = time.perf_counter()
    with torch.no_grad():
        for text in TEXTS:
            ids = tokenize_text(tok, load_text(text, "eval"))
            out["perplexity"][text] = perplexity(model, ids, seq_len=SEQ, max_windows=WINDOWS, progress=False).perplexity
        probe = key_probe(model, tok, PasskeySettings(**PROBE), PROBE_LENGTHS)
        out["keys"] = {k: probe[k] for k in ("nll", "exact", "keys")}
        recall = score_items(model, recall_items(tok, ChoiceSettings(**RECALL)))
        out["recall"] = {k: recall[k] for k in ("items", "acc", "nll")}
    out["eval_seconds"] = round(time.perf_counter() - start, 1)
    return out


def run(name: str, care: Path | None, samples: int, cache: ResultCache) -> None:
    from transmla.checkpoint.resolve import load_model, resolve_model_dir

    env = machine()
    source_dir = resolve_model_dir(MODEL)
    row: dict = {"machine": env}
    if name == "source":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(source_dir, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(source_dir)
        row |= {"fraction": 1.0, "shape": "source"}
    elif name in CLI_RUNS:
        fraction, folder = CLI_RUNS[name]
        model, tok = load_model(ROOT / folder)
        row |= {"fraction": fraction, "shape": cli_shape(folder), "folder": folder}
    else:
        if care is None:
            raise SystemExit(f"{name}: give --care DIR (a checkout of FutureMLS-Lab/CARE)")
        fraction, rank, mqa = CARE_RUNS[name]
        start = time.perf_counter()
        model, tok = care_model(care / "src", source_dir, rank, mqa, samples)
        row |= {"fraction": fraction, "shape": f"{rank} + {mqa}", "convert_seconds": round(time.perf_counter() - start, 1),
                "care": {"commit": CARE_COMMIT, "kv_lora_rank": rank, "qk_mqa_dim": mqa, "freqfold": FREQFOLD,
                         "damping": DAMPING, "samples": samples, "seq": CAL_SEQ, "method": "care", "dtype": "fp32"}}
    row |= measure(model, tok)
    row["load_after"] = round(os.getloadavg()[0], 2)
    row["date"] = time.strftime("%Y-%m-%d %H:%M")
    cache.results[name] = row
    cache.save()
    log(f"{name}: {row['perplexity']} keys {row['keys']} recall {row['recall']}")


def cli_shape(folder: str) -> str:
    """'latent + rope (CLI)' of a CLI conversion's folder."""
    mla = json.loads((ROOT / folder / "config.json").read_text())["mla"]
    return f"{mla['kv_lora_rank']} + {mla['qk_rope_head_dim']} (CLI)"


def report(results: dict) -> str:
    src = results.get("source")
    lines = [f"# CARE (its own code) beside the CLI on {MODEL}, the same cache per token", "",
             "Made by `python -m benchmarks.care_peer` (protocol and CARE's settings in its docstring). Perplexity on "
             f"the first {WINDOWS} windows of {SEQ} tokens of each evaluation part (x: over the source's); keys: the "
             "passkey likelihood probe (test seed 0, 1K/2K/4K, depths 10/50/90, 5 keys: mean key NLL / exact of 45); "
             "recall: 60 items (seed 0), accuracy / nll (chance 25%). CARE calibrates on the wiki text only (its own "
             "default is wikitext2); the CLI's default calibration mixes wiki, lee and code (3 : 1 : 2), which is part "
             "of the gap on code.", "",
             "| run | cache | latent + rope | wiki | lee | code | keys | recall | convert s | CPU, load |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    order = ["source", *[n for f in (0.5, 0.25) for n in (*CLI_RUNS, *CARE_RUNS)
                         if (CLI_RUNS.get(n) or CARE_RUNS.get(n))[0] == f]]
    for name in order:
        r = results.get(name)
        if r is None:
            continue
        ppl = r["perplexity"]
        cells = [f"{ppl[t]:.2f}" + (f" ({ppl[t] / src['perplexity'][t]:.2f}x)" if src and name != "source" else "")
                 for t in TEXTS]
        keys, rec = r["keys"], r["recall"]
        env = r["machine"]
        lines.append(f"| {name} | {r['fraction']:.0%} | {r['shape']} | {' | '.join(cells)} | {keys['nll']:.3f} / "
                     f"{keys['exact']} | {rec['acc']:.0%} / {rec['nll']:.3f} | {r.get('convert_seconds', '-')} | "
                     f"{env['machine']}, {env['threads']} thread(s), load {env['load_average']}-{r['load_after']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    runs = ["source", *CLI_RUNS, *CARE_RUNS]
    parser.add_argument("--runs", default=",".join(runs), help=f"comma-separated, of {', '.join(runs)}")
    parser.add_argument("--care", type=Path, help="a checkout of FutureMLS-Lab/CARE (its src is imported)")
    parser.add_argument("--samples", type=int, default=128, help="CARE's calibration sequences of 256 tokens")
    parser.add_argument("--report", action="store_true", help="only rewrite the table")
    args = parser.parse_args()
    cache = ResultCache(RESULTS / f"{STEM}.json")
    if not args.report:
        for name in [n for n in args.runs.split(",") if n]:
            if name not in runs:
                parser.error(f"unknown run {name}; choose from {', '.join(runs)}")
            if name not in cache.results:
                run(name, args.care, args.samples, cache)
    (RESULTS / f"{STEM}.md").write_text(report(cache.results))


if __name__ == "__main__":
    main()
