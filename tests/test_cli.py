"""The command line: real commands on tiny checkpoints, and one-line errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

from transmla.cli.app import main


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def run(capsys, monkeypatch):
    """Run the CLI in this process (as the console script does) and capture its output."""

    def invoke(*args, env=None):
        for key, value in (env or {}).items():
            monkeypatch.setenv(key, value)
        capsys.readouterr()
        code = main([str(a) for a in args])
        out = capsys.readouterr()
        return Result(code, out.out, out.err)

    return invoke


def test_console_script_exit_code(tmp_path):
    """One real subprocess: the installed entry point exits non-zero with a one-line error."""
    proc = subprocess.run([sys.executable, "-m", "transmla.cli.app", "inspect", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=300)
    assert_one_line_error(proc, "no such file or directory")


def assert_one_line_error(proc, needle):
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.strip().splitlines() if line.startswith("error:")]
    assert lines and needle in lines[-1], proc.stderr
    assert "Traceback" not in proc.stderr


def test_convert_inspect_eval_generate(tiny_factory, tmp_path, run):
    _, path = tiny_factory("qwen2", bias=True)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{i % 13}" for i in range(3000)))
    out = tmp_path / "mla"
    proc = run("convert", path, out, "--method", "lossless", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["kv_elements_per_token_per_layer"] == 32

    info = json.loads(run("inspect", out, "--json").stdout)
    assert info["attention"] == "MLA" and info["kv_elements_per_token_per_layer"] == 32
    assert info["kv_bytes_per_token"] == 32 * 4 * 2 and info["cache_ratio"] == 1.0
    src_info = json.loads(run("inspect", path, "--json").stdout)
    assert src_info["attention"] == "GQA" and src_info["kv_heads"] == 2


def test_eval_equal_for_source_and_lossless(tiny_factory, tmp_path, run):
    from transformers import AutoTokenizer  # noqa: F401

    # A tiny model needs a tokenizer on disk for the CLI: borrow a word-level one.
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    _, path = tiny_factory("llama")
    vocab = {f"w{i}": i for i in range(96)} | {"[UNK]": 96}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{(i * 7) % 96}" for i in range(700)))
    out = tmp_path / "mla"
    assert run("convert", path, out).returncode == 0
    a = json.loads(run("eval", path, "--data", text, "--seq-len", "64", "--json").stdout)
    b = json.loads(run("eval", out, "--data", text, "--seq-len", "64", "--json").stdout)
    assert a["tokens"] == b["tokens"] == 10 * 63
    assert abs(a["perplexity"] - b["perplexity"]) / a["perplexity"] < 1e-5
    gen = run("generate", out, "w1 w2 w3", "--max-new-tokens", "4", "--json")
    assert gen.returncode == 0, gen.stderr
    payload = json.loads(gen.stdout)
    assert payload["new_tokens"] == 4 and payload["cache_bytes"] > 0


def test_missing_path(tmp_path, run):
    assert_one_line_error(run("inspect", tmp_path / "nope"), "no such file or directory")
    assert_one_line_error(run("convert", "./missing-model", tmp_path / "o"), "no such file or directory")


def test_unsupported_architecture(tmp_path, run):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50)).save_pretrained(tmp_path / "gpt2")
    proc = run("convert", tmp_path / "gpt2", tmp_path / "o")
    assert_one_line_error(proc, "unsupported architecture 'gpt2'")
    assert "llama" in proc.stderr and "mixtral" in proc.stderr
    assert not (tmp_path / "o").exists()


def test_non_empty_output_needs_force(tiny_factory, tmp_path, run):
    _, path = tiny_factory("llama")
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    assert_one_line_error(run("convert", path, out), "--force")
    assert (out / "keep.txt").read_text() == "user data"
    assert run("convert", path, out, "--force").returncode == 0
    assert (out / "config.json").exists() and not (out / "keep.txt").exists()


def test_unreachable_hub_id(tmp_path, run):
    start = time.time()
    proc = run("inspect", "some-org/some-model-that-is-not-here", env={"HF_HUB_OFFLINE": "1"})
    assert_one_line_error(proc, "Hugging Face Hub could not provide it")
    assert "smollm2-135m" in proc.stderr
    assert time.time() - start < 120


def test_bad_options(tiny_factory, tmp_path, run):
    _, path = tiny_factory("llama")
    assert_one_line_error(run("convert", path, tmp_path / "o", "--method", "magic"), "unknown method 'magic'")
    assert_one_line_error(run("convert", path, tmp_path / "o", "--max-shard-size", "lots"), "invalid size")
    assert_one_line_error(run("convert", path, tmp_path / "o", "--dtype", "fp8"), "dtype must be one of")
    # the library names settings by field; the CLI's errors name the flags
    convert = ("convert", path, tmp_path / "o", "--method")
    assert_one_line_error(run(*convert, "mha2mla", "--rope-dim", 8, "-R", 8), "--rope-dim does not apply to method mha2mla")
    assert_one_line_error(run(*convert, "transmla", "--kv-budget", 0.5, "-R", 4),
                          "give either --kv-budget or --kv-lora-rank/--rope-dim, not both")
    assert_one_line_error(run(*convert, "mha2mla", "-R", 8, "--svd", "tucker"), "--svd must be one of")
    assert_one_line_error(run(*convert, "transmla", "--kv-budget", 0.5, "--propagate", "x"), "--propagate must be one of")
    # the rope shape is TransMLA's setting: the other methods refuse it as they refuse its other flags
    assert_one_line_error(run(*convert, "lossless", "--per-layer-rope"), "--shared-rope/--per-layer-rope does not apply to method lossless")
    assert_one_line_error(run(*convert, "mha2mla", "--shared-rope"), "--shared-rope/--per-layer-rope does not apply to method mha2mla")
    assert_one_line_error(run(*convert, "transmla", "--kv-budget", 0.25, "--per-layer-rope", "--format", "deepseek"),
                          "format deepseek needs one rope grid shared by all layers")
    assert_one_line_error(run("eval", path, "--measure-cache", -1), "--measure-cache must be 0 or more")


def test_debug_env_raises_with_traceback(tmp_path, monkeypatch):
    monkeypatch.setenv("TRANSMLA_DEBUG", "1")
    with pytest.raises(FileNotFoundError):
        main(["inspect", str(tmp_path / "nope")])
