"""Evaluation reports, the measured cache and the budget sweep, on tiny random models.

The perplexity itself is checked against a by-hand computation in test_perplexity.py; here:
--compare on a source and its lossless conversion (same perplexity, cache ratio 1), the two
protocols agreeing where they must (stride = window), report files well formed, measured cache
bytes equal to the formula for source and MLA caches, a clear error for an unreachable dataset,
and `transmla sweep` with the real methods at two budgets.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SEQ = 32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama (GQA: 6 heads, 2 KV heads, head_dim 8) with a tokenizer, its lossless
    conversion, and a text file."""
    from conftest import make_tiny_model, save_word_tokenizer

    from transmla.convert.api import convert
    from transmla.convert.options import ConvertOptions

    root = tmp_path_factory.mktemp("report")
    src = root / "src"
    make_tiny_model("llama", src)
    save_word_tokenizer(src)
    mla = root / "mla"
    convert(str(src), mla, ConvertOptions.of(method="lossless"), progress=False)
    g = torch.Generator().manual_seed(0)
    words = torch.randint(0, 96, (2400,), generator=g).tolist()
    text = root / "text.txt"
    text.write_text(" ".join(f"w{(w // 4) * 4 + i % 4}" for i, w in enumerate(words)))
    return {"root": root, "src": src, "mla": mla, "text": text}


def _error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.startswith("error:")]
    assert lines, err
    assert "Traceback" not in err
    return lines[-1]


def _assert_png(path: Path) -> None:
    assert path.is_file() and path.read_bytes()[:8] == PNG_MAGIC
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    img = plt.imread(path)
    assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 300


# --- eval --compare --report ----------------------------------------------------------------


def test_compare_lossless_report(tiny, cli, tmp_path):
    out = tmp_path / "report"
    code, stdout, err = cli("eval", tiny["mla"], "--compare", tiny["src"], "--data", tiny["text"],
                            "--seq-len", SEQ, "--max-windows", 6, "--context", 4096, "--measure-cache", 5,
                            "--report", out, "--json")
    assert code == 0, err
    r = json.loads(stdout)
    # the existing keys of `transmla eval --json` are still there, for the evaluated model
    for key in ("perplexity", "tokens", "windows", "seq_len", "kv_elements_per_token_per_layer"):
        assert key in r
    assert r["tokens"] == r["source"]["tokens"] == 6 * (SEQ - 1) and r["windows"] == 6
    assert r["perplexity"] == pytest.approx(r["source"]["perplexity"], rel=1e-5)  # lossless
    assert r["comparison"]["cache_ratio"] == 1.0 and r["comparison"]["measured_cache_ratio"] == 1.0
    assert abs(r["comparison"]["perplexity_change_pct"]) < 1e-3
    assert r["kv_elements_per_token_per_layer"] == 2 * 2 * 8
    assert r["context"] == 4096 and r["kv_bytes_at_context"] == 32 * 4 * 2 * 4096  # el. x fp32 x layers x tokens

    report = json.loads((out / "report.json").read_text())
    assert report["protocol"]["name"] == "non-overlapping"
    assert "6 non-overlapping 32-token windows" in report["protocol"]["description"]
    assert [m["role"] for m in report["models"]] == ["source", "converted"]
    assert [m["attention"] for m in report["models"]] == ["GQA", "MLA"]
    for m in report["models"]:
        mc = m["measured_cache"]
        assert mc["matches_formula"] and mc["cached_tokens"] == 32 + 5
        assert mc["measured_bytes"] == 32 * 4 * 2 * (32 + 5)
    assert report["environment"]["torch"] == torch.__version__

    md = (out / "report.md").read_text()
    assert "| perplexity |" in md and "|---|---|---|---|" in md
    assert "non-overlapping" in md and "![perplexity](perplexity.png)" in md
    assert "| KV cache at 4,096 tokens |" in md
    for name in ("perplexity.png", "kv_cache.png"):
        _assert_png(out / name)


def test_a_toy_result_field_is_a_change_in_one_room(tiny, cli, tmp_path, monkeypatch):
    """docs/USAGE.md, "Adding a result field": a field of ModelEntry, set in model_entry() and given a row
    by compare_rows(), all three in eval/report.py, reaches report.json (both models, in declaration
    order), report.md and the --json line's source entry, with nothing else changed."""
    import dataclasses

    from transmla.eval import report as rep

    entry_type = dataclasses.make_dataclass("ModelEntry", [("toy_score", float | None, dataclasses.field(default=None))],
                                            bases=(rep.ModelEntry,))
    monkeypatch.setattr(entry_type, "OPTIONAL", rep.ModelEntry.OPTIONAL + ("toy_score",))
    plain_entry, plain_rows = rep.model_entry, rep.compare_rows

    def model_entry(spec, role, *args, **kwargs):
        entry = plain_entry(spec, role, *args, **kwargs)  # builds the module's ModelEntry: the toy one
        return dataclasses.replace(entry, toy_score=len(role) / 10)

    def compare_rows(report):
        header, rows = plain_rows(report)
        return header, rows + [["toy score", *(f"{m['toy_score']:.1f}" for m in report["models"])] + [""]]

    monkeypatch.setattr(rep, "ModelEntry", entry_type)
    monkeypatch.setattr(rep, "model_entry", model_entry)
    monkeypatch.setattr(rep, "compare_rows", compare_rows)
    out = tmp_path / "report"
    code, stdout, err = cli("eval", tiny["mla"], "--compare", tiny["src"], "--data", tiny["text"],
                            "--seq-len", SEQ, "--max-windows", 2, "--report", out, "--json")
    assert code == 0, err
    assert json.loads(stdout)["source"]["toy_score"] == pytest.approx(0.6)  # len("source") / 10
    models = json.loads((out / "report.json").read_text())["models"]
    assert [m["toy_score"] for m in models] == pytest.approx([0.6, 0.9])  # source, converted
    assert list(models[0])[-1] == "toy_score"
    assert "| toy score | 0.6 | 0.9 |" in (out / "report.md").read_text()


def test_compare_table_on_stdout(tiny, cli):
    code, stdout, err = cli("eval", tiny["mla"], "--compare", tiny["src"], "--data", tiny["text"],
                            "--seq-len", SEQ, "--max-windows", 2, "--measure-cache", 0)
    assert code == 0, err
    assert "perplexity" in stdout and "cache ratio" in stdout and "non-overlapping" in stdout


def test_protocols_agree_where_they_must(tiny, cli, tmp_path):
    base = ("eval", tiny["src"], "--data", tiny["text"], "--seq-len", SEQ, "--max-windows", 5, "--json")
    a = json.loads(cli(*base)[1])
    b = json.loads(cli(*base, "--stride", SEQ)[1])
    assert a["protocol"] == "non-overlapping" and b["protocol"] == "sliding"
    assert (a["perplexity"], a["tokens"], a["windows"]) == (b["perplexity"], b["tokens"], b["windows"])
    code, stdout, err = cli(*base, "--stride", 8, "--report", tmp_path / "r", "--measure-cache", 0)
    assert code == 0, err
    c = json.loads(stdout)
    assert c["tokens"] == 5 * SEQ - 1 and c["perplexity"] != a["perplexity"]  # every token of the span but one
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["protocol"]["name"] == "sliding" and report["protocol"]["stride"] == 8
    assert "stride 8" in report["protocol"]["description"]
    assert "sliding" in (tmp_path / "r" / "report.md").read_text()


def test_compare_refuses_another_tokenizer(tiny, cli, tmp_path):
    from conftest import make_tiny_model
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    other = tmp_path / "other"
    make_tiny_model("llama", other, seed=1)
    vocab = {f"w{i}": 95 - i for i in range(96)} | {"[UNK]": 96}  # same words, other ids
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(other)
    code, _, err = cli("eval", other, "--compare", tiny["src"], "--data", tiny["text"], "--seq-len", SEQ,
                       "--max-windows", 1)
    assert code == 1 and "tokenizes the text differently" in _error_line(err)


def test_unreachable_dataset_clear_error(tiny, cli, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    code, _, err = cli("eval", tiny["src"], "--data", "no-such-org/no-such-dataset", "--seq-len", SEQ)
    assert code == 1
    line = _error_line(err)
    assert "could not fetch dataset 'no-such-org/no-such-dataset'" in line
    assert "'wiki'" in line and ".jsonl" in line  # says what works offline


def test_unreachable_hub_with_datasets_installed(tiny, cli, monkeypatch):
    """Where `datasets` is installed but the hub cannot be reached, the same one-line error."""
    import sys
    import types

    fake = types.ModuleType("datasets")

    def load_dataset(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'wikitext' on the Hub (LocalEntryNotFoundError)\nmore detail")

    fake.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", fake)
    code, _, err = cli("eval", tiny["src"], "--data", "wikitext-2-raw-v1", "--seq-len", SEQ)
    assert code == 1
    line = _error_line(err)
    assert "could not fetch dataset 'wikitext-2-raw-v1'" in line and "ConnectionError" in line


# --- measured cache ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_measured_cache_equals_formula(tiny, tmp_path, dtype):
    from transformers import AutoModelForCausalLM

    import transmla  # noqa: F401  (registers the MLA models)
    from transmla.convert.api import convert
    from transmla.convert.options import ConvertOptions
    from transmla.eval.kv import kv_summary
    from transmla.eval.measured_cache import measure_cache

    small = tmp_path / "mha2mla"  # a cache that really shrinks: R + 2*g*P = 16 of 32 elements
    convert(str(tiny["src"]), small, ConvertOptions.of(method="mha2mla", kv_budget=0.5), progress=False)
    prompt = torch.arange(3, 14)  # [11]
    expect = {"src": 32, "mla": 32, "mha2mla": 16}
    for name, path in (("src", tiny["src"]), ("mla", tiny["mla"]), ("mha2mla", small)):
        net = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        modes = ["absorbed", "expanded"] if name != "src" else [None]
        for mode in modes:
            m = measure_cache(net, prompt, new_tokens=4, decode=mode)
            nbytes = 4 if dtype == torch.float32 else 2
            assert m.cached_tokens == 11 + 4 and m.layers == 2
            assert m.measured_elements == expect[name] * 2 * 15
            assert m.measured_bytes == m.formula_bytes == expect[name] * nbytes * 2 * 15
            assert m.matches and m.to_dict()["matches_formula"]
            assert m.measured_bytes_per_token_per_layer == kv_summary(net.config, dtype).kv_bytes_per_token_per_layer
            assert m.attention == ("GQA" if name == "src" else "MLA")
        if name != "src":
            assert net.config.mla["decode"] == "auto"  # restored


# --- sweep ------------------------------------------------------------------------------------


def test_sweep_two_methods_two_budgets(tiny, cli, tmp_path):
    out = tmp_path / "sweep"
    code, stdout, err = cli(
        "sweep", tiny["src"], "--method", "transmla,mha2mla", "--budgets", "0.5,0.25", "--out", out,
        "--data", tiny["text"], "--seq-len", SEQ, "--max-windows", 4,
        "--calib", tiny["text"], "--calib-samples", 4, "--calib-seq-len", SEQ, "--json",
    )
    assert code == 0, err
    result = json.loads(stdout)
    assert "budgets" in err and "eta" in err  # a progress bar over the budgets
    on_disk = json.loads((out / "sweep.json").read_text())
    assert on_disk["rows"] == result["rows"]
    rows = result["rows"]
    assert [(r["method"], r["budget"]) for r in rows] == [
        ("transmla", 0.5), ("transmla", 0.25), ("mha2mla", 0.5), ("mha2mla", 0.25)]
    for r in rows:
        assert r["kv_elements_per_token_per_layer"] == int(32 * r["budget"])
        assert r["cache_fraction"] == r["budget"]
        assert r["tokens"] == result["source"]["tokens"] == 4 * (SEQ - 1)
        assert math.isfinite(r["perplexity"]) and r["model_dir"] is None
        assert r["kv_lora_rank"] + r["qk_rope_head_dim"] == r["kv_elements_per_token_per_layer"]
    assert result["protocol"]["name"] == "non-overlapping"
    assert not (out / "models").exists()  # discarded without --keep
    md = (out / "sweep.md").read_text()
    assert "| method |" in md and "| source |" in md and md.count("| transmla |") == 2
    _assert_png(out / "sweep.png")


def test_sweep_keep_matches_eval(tiny, cli, tmp_path):
    out = tmp_path / "sweep"
    code, stdout, err = cli("sweep", tiny["src"], "--method", "mha2mla", "--budgets", "0.5", "--out", out,
                            "--data", tiny["text"], "--seq-len", SEQ, "--max-windows", 3, "--keep", "--json")
    assert code == 0, err
    row = json.loads(stdout)["rows"][0]
    kept = Path(row["model_dir"])
    assert (kept / "config.json").is_file()
    again = json.loads(cli("eval", kept, "--data", tiny["text"], "--seq-len", SEQ, "--max-windows", 3, "--json")[1])
    assert again["perplexity"] == pytest.approx(row["perplexity"], rel=1e-6)


def test_sweep_bad_arguments(tiny, cli, tmp_path):
    base = ("sweep", tiny["src"], "--out", tmp_path / "o", "--data", tiny["text"], "--seq-len", SEQ)
    code, _, err = cli(*base, "--budgets", "0.5,2")
    assert code == 1 and "between 0 and 1" in _error_line(err)
    code, _, err = cli(*base, "--budgets", "half")
    assert code == 1 and "budgets must be numbers" in _error_line(err)
    code, _, err = cli(*base, "--method", "magic")
    assert code == 1 and "unknown method 'magic'" in _error_line(err)
    code, _, err = cli(*base, "--method", "lossless")
    assert code == 1 and "no budget to sweep" in _error_line(err)


def test_sweep_with_a_fake_method(tiny, tmp_path):
    """The sweep machinery alone: any convert function that writes a model folder."""
    from transmla.convert.api import convert
    from transmla.convert.options import ConvertOptions
    from transmla.eval.settings import EvalSettings
    from transmla.sweep import sweep

    seen = []

    def fake_convert(source, output, options, progress=True):
        seen.append((options.method, options.settings.kv_budget, options.output.force))
        return convert(source, output, ConvertOptions.of(method="mha2mla", kv_budget=options.settings.kv_budget, force=True),
                       progress=False)

    settings = EvalSettings(data=str(tiny["text"]), seq_len=SEQ, max_windows=2, progress=False, measure_tokens=3)
    result = sweep(str(tiny["src"]), ["transmla"], [0.5, 0.25], tmp_path / "s", settings, convert_fn=fake_convert,
                   command="test")
    assert seen == [("transmla", 0.5, True), ("transmla", 0.25, True)]
    assert [r["kv_elements_per_token_per_layer"] for r in result["rows"]] == [16, 8]
    assert all(r["measured_cache"]["matches_formula"] for r in result["rows"])
    assert result["source"]["measured_cache"]["matches_formula"]
    assert result["rows"][0]["setting"] == ""  # convert's defaults: no label


def test_plot_sweep_many_lines(tmp_path):
    from transmla.eval.plots import plot_sweep

    lines = {"transmla": [(0.5, 33.0), (0.25, 84.0), (0.125, 259.0)], "mha2mla (2norm)": [(0.5, 1545.0), (0.125, 8e4)]}
    path = plot_sweep(lines, 18.15, tmp_path / "p" / "x.png", title="t", subtitle="s")
    _assert_png(path)
