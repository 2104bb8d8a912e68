"""Adding an engine export target is a change in one room: a toy target registered in
export/targets.py's TARGETS is what `transmla export --format toy` and write_export() run, with every
export setting handed to it and its summary printed as the command prints any target's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from transmla.convert.api import convert
from transmla.convert.options import ConvertOptions
from transmla.export import targets
from transmla.export.targets import ExportTarget, write_export
from transmla.mla.config import MLAConfig


def _write_toy(model: str, output: Path, settings: dict) -> dict:
    """A toy engine's format: the latent width of every layer, one line each."""
    from transmla.checkpoint.resolve import load_config, resolve_model_dir

    mla = MLAConfig.from_dict(load_config(resolve_model_dir(model)).mla)
    if output.exists() and not settings["force"]:
        raise FileExistsError(f"{output} exists (pass --force to replace it)")
    output.write_text("".join(f"{mla.kv_elements_per_token_per_layer}\n" for _ in mla.rope_inv_freq))
    return {"output": str(output), "format": "toy", "layers": len(mla.rope_inv_freq),
            "kv_elements_per_token_per_layer": mla.kv_elements_per_token_per_layer,
            "dropped_biases": settings["drop_biases"]}


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(targets.TARGETS, "toy", ExportTarget("toy", "one line per layer", _write_toy))


@pytest.fixture
def native(tiny_factory, tmp_path):
    _, src = tiny_factory("llama")
    out = tmp_path / "mla"
    convert(str(src), out, ConvertOptions.of(device="cpu"), progress=False)
    return out


def test_a_toy_target_runs_through_the_export_command(cli, toy, native, tmp_path):
    out = tmp_path / "model.toy"
    code, stdout, err = cli("export", native, out, "--format", "toy", "--drop-biases", "--json")
    assert code == 0, err
    summary = json.loads(stdout)
    assert summary["format"] == "toy" and summary["dropped_biases"] is True
    width = summary["kv_elements_per_token_per_layer"]
    assert out.read_text().splitlines() == [str(width)] * summary["layers"]
    code, _, err = cli("export", native, out, "--format", "toy")  # the command's settings reach it
    assert code == 1 and "exists" in err
    assert cli("export", native, out, "--format", "toy", "--force")[0] == 0


def test_a_toy_target_runs_through_the_api(toy, native, tmp_path):
    settings = {"force": False, "drop_biases": False}
    summary = write_export("toy", str(native), tmp_path / "m.toy", settings)
    assert summary["layers"] == len((tmp_path / "m.toy").read_text().splitlines())


def test_an_unknown_target_is_refused_naming_the_registered_ones(cli, toy, native, tmp_path):
    code, _, err = cli("export", native, tmp_path / "x", "--format", "nope")
    assert code == 1 and err.strip() == "error: --format must be one of deepseek, gguf, gguf-ik, toy, got 'nope'"
