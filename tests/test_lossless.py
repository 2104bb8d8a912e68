"""Lossless conversion through real files: logits equal the source's for every family."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import transmla  # noqa: F401  (registers the MLA models)
from transmla.convert.api import convert
from transmla.convert.options import ConvertOptions


@pytest.mark.parametrize("family,bias", [("llama", False), ("llama", True), ("qwen2", True), ("mistral", False), ("mixtral", False)])
def test_lossless_logits_equal_source(tiny_factory, tmp_path, family, bias):
    source, path = tiny_factory(family, bias=bias)
    out = tmp_path / "mla"
    result = convert(str(path), out, ConvertOptions.of(method="lossless"), progress=False)
    assert result.kv_elements_per_token_per_layer == result.source_kv_elements_per_token_per_layer == 2 * 2 * 8
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(model).__name__.startswith("MLA")
    ids = torch.randint(0, 97, (2, 17))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, source(ids).logits, atol=1e-5, rtol=1e-5)
    if bias:  # the non-zero biases really travelled
        assert json.loads((out / "config.json").read_text())["mla"]["kv_a_bias"] is True


def test_lossless_with_mha_source(tiny_factory, tmp_path):
    source, path = tiny_factory("llama", num_key_value_heads=6)
    convert(str(path), tmp_path / "mla", ConvertOptions.of(), progress=False)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "mla", dtype=torch.float32).eval()
    ids = torch.randint(0, 97, (1, 11))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, source(ids).logits, atol=1e-5, rtol=1e-5)


def test_sharded_output_and_dtype(tiny_factory, tmp_path):
    _, path = tiny_factory("llama")
    out = tmp_path / "mla"
    result = convert(str(path), out, ConvertOptions.of(max_shard_size="20KB", dtype="bf16"), progress=False)
    assert len(result.files) > 2
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) | {"model.safetensors.index.json"} == set(result.files)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folders left


def test_failed_conversion_leaves_nothing(tiny_factory, tmp_path, monkeypatch):
    _, path = tiny_factory("llama")
    from transmla.convert import registry
    from transmla.convert.lossless.method import Lossless

    class Broken(Lossless):
        name = "broken"

        def convert_layer(self, plan, source, stats):
            if self.done:
                raise RuntimeError("boom in the middle")
            self.done = True
            return super().convert_layer(plan, source, stats)

    broken = Broken()
    broken.done = False
    monkeypatch.setitem(registry.METHODS, "broken", broken)
    with pytest.raises(RuntimeError, match="boom"):
        convert(str(path), tmp_path / "out", ConvertOptions.of(method="broken"), progress=False)
    assert broken.done  # one layer was written before the failure
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama-src"]
