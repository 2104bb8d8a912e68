"""Hardening (issue 14): nothing runs from files we load, no non-finite model, nothing left behind
after signals, meaningful exit codes, no writes outside the output folder, our warnings visible."""

from __future__ import annotations

import json
import pickle
import random
from pathlib import Path

import pytest
import yaml

from conftest import make_tiny_model, save_word_tokenizer


class _Planted:
    """Unpickling this creates a file: proof that a loaded pickle ran code."""

    def __init__(self, sentinel: Path):
        self.sentinel = sentinel

    def __reduce__(self):
        return (open, (str(self.sentinel), "w"))


def _plant_pickles(folder: Path, sentinel: Path) -> None:
    payload = pickle.dumps(_Planted(sentinel))
    for name in ("custom_checkpoint_0.pkl", "random_states_0.pkl", "optimizer.bin", "scheduler.bin", "pytorch_model.bin"):
        (folder / name).write_bytes(payload)


@pytest.fixture(scope="module")
def mla(tmp_path_factory):
    """A tiny lossless MLA model with a tokenizer, and a training text."""
    from transmla.convert.api import convert
    from transmla.convert.options import ConvertOptions

    root = tmp_path_factory.mktemp("hard")
    make_tiny_model("llama", root / "src")
    save_word_tokenizer(root / "src")
    convert(str(root / "src"), root / "mla", ConvertOptions(method="lossless"), progress=False)
    rng = random.Random(0)
    (root / "train.txt").write_text("\n\n".join(" ".join(f"w{rng.randrange(96)}" for _ in range(80)) for _ in range(40)))
    return root


def _recipe(root: Path, out: Path, **extra) -> dict:
    data = {
        "model": {"path": str(root / "mla")},
        "data": {"train": str(root / "train.txt"), "seq_len": 16},
        "train": {"steps": 4, "trainable": "mla", "micro_batch_size": 2, "device": "cpu", "threads": 1},
        "eval": {"data": None},
        "checkpoint": {"every": 2},
        "output_dir": str(out),
    }
    return data | extra


# --- 1. no code runs from a file we load ------------------------------------------------------


@pytest.mark.parametrize("how", ["auto", "explicit"])
def test_planted_pickle_in_checkpoint_never_runs(mla, tmp_path, how):
    from transmla.finetune.recipe import parse_recipe
    from transmla.finetune.train import run_finetune

    out = tmp_path / "run"
    first = run_finetune(parse_recipe(_recipe(mla, out)), stop_after=2, progress=False)
    assert first.steps == 2 and not first.completed
    step = out / "checkpoints" / "step-000002"
    sentinel = tmp_path / "pwned"
    _plant_pickles(step, sentinel)
    resume = {"checkpoint": {"every": 2, "resume": "auto" if how == "auto" else str(step)}}
    second = run_finetune(parse_recipe(_recipe(mla, out, **resume)), progress=False)
    assert second.completed and second.resumed_from == str(step) and second.steps == 4
    assert not sentinel.exists()


def test_checkpoint_holds_no_pickle(mla, tmp_path):
    from transmla.finetune.recipe import parse_recipe
    from transmla.finetune.train import run_finetune

    run_finetune(parse_recipe(_recipe(mla, tmp_path / "run")), stop_after=2, progress=False)
    files = sorted(p.name for p in (tmp_path / "run" / "checkpoints" / "step-000002").iterdir())
    assert all(name.endswith((".safetensors", ".json")) for name in files), files


# --- 2. no non-finite model written, no NaN reported as a result -------------------------------


def _poisoned(tmp_path: Path, name: str, value: float, where=(0, 0)) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    src = tmp_path / "poisoned"
    make_tiny_model("llama", src)
    save_word_tokenizer(src)
    tensors = load_file(src / "model.safetensors")
    t = tensors[name]
    t[where if t.ndim == 2 else where[0]] = value if value == value else torch.nan
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    return src


@pytest.mark.parametrize("method", ["lossless", "transmla"])
@pytest.mark.parametrize("name", ["model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight"])
def test_non_finite_source_refused_by_name_nothing_written(cli, tmp_path, method, name):
    src = _poisoned(tmp_path, name, float("nan"))
    out = tmp_path / "out"
    args = ["--calib-samples", "4", "--calib-seq-len", "8", "--kv-budget", "0.5"] if method == "transmla" else []
    code, stdout, err = cli("convert", src, out, "--method", method, *args)
    assert code == 1 and stdout == ""
    assert name in err and "non-finite" in err, err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["poisoned"]


def test_non_finite_calibration_statistics_fail(cli, tmp_path):
    src = _poisoned(tmp_path, "model.layers.1.input_layernorm.weight", 3e38)  # finite, but overflows on the way
    code, _, err = cli("convert", src, tmp_path / "out", "--method", "transmla", "--kv-budget", "0.5",
                       "--calib-samples", "4", "--calib-seq-len", "8")
    assert code == 1 and "layer 1's calibration statistics" in err and "non-finite" in err, err
    assert not (tmp_path / "out").exists()


def test_writer_refuses_non_finite_tensor(tmp_path):
    import torch

    from transmla.checkpoint.writer import ShardedWriter

    with pytest.raises(ValueError, match="'b' has 1 non-finite value"):
        with ShardedWriter(tmp_path / "w") as writer:
            writer.add("a", torch.ones(3))
            writer.add("b", torch.tensor([1.0, float("inf")]))
    assert list((tmp_path / "w").iterdir()) == []


def test_eval_fails_on_non_finite_loss(cli, tmp_path):
    src = _poisoned(tmp_path, "model.norm.weight", float("nan"))
    (tmp_path / "t.txt").write_text(" ".join(f"w{i % 50}" for i in range(400)))
    code, stdout, err = cli("eval", src, "--data", tmp_path / "t.txt", "--seq-len", "32", "--json")
    assert code == 1 and stdout == "" and "NaN or Inf" in err, (stdout, err)


def test_truncated_shard_error_names_the_file(cli, tmp_path):
    src = tmp_path / "src"
    make_tiny_model("llama", src)
    shard = src / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    code, _, err = cli("convert", src, tmp_path / "out")
    assert code == 1 and str(shard) in err, err
    shard.write_bytes(b"\x05")
    code, _, err = cli("convert", src, tmp_path / "out")
    assert code == 1 and str(shard) in err, err
