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
