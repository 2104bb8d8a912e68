"""Sliding-window layers of the Llama-like families (families/base.source_window): Mistral and Mixtral
(sliding_window on every layer), Qwen2 and Qwen3 (use_sliding_window, from max_window_layers on).
A converted model keeps each layer's window as transformers applies it: lossless equals the source past
the window in prefill and in token-by-token decode through the latent cache (the CPU decode kernel),
and the DeepSeek and GGUF exports, which have no sliding window, refuse with the reason."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from conftest import assert_kernel_decode_equals_source, assert_logits_close, make_tiny_model, random_ids

import transmla  # noqa: F401  (registers the MLA models)
from transmla.convert.api import convert
from transmla.convert.options import ConvertOptions
from transmla.export.errors import ExportError
from transmla.families import family_for

WINDOW = 6  # shorter than the 24-token prompts, so the window shows in prefill and decode
HEAD = dict(head_dim=16, initializer_range=0.2)  # cache rows 2*2*16 = 64 wide: a shape the CPU kernel takes
SLIDING = {  # family -> (its window settings, the windows each of its 2 layers gets)
    "mistral": ({"sliding_window": WINDOW}, [WINDOW, WINDOW]),
    "mixtral": ({"sliding_window": WINDOW}, [WINDOW, WINDOW]),
    "qwen2": ({"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}, [0, WINDOW]),
    "qwen3": ({"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}, [0, WINDOW]),
}


def _windows(config) -> list:
    return [family_for(config).window(config, i) for i in range(config.num_hidden_layers)]


def test_source_window_follows_transformers():
    assert _windows(MistralConfig(num_hidden_layers=2, max_position_embeddings=32768)) == [4096, 4096]  # its default
    assert _windows(MistralConfig(num_hidden_layers=2, sliding_window=None)) == [None, None]
    # a window of at least the context never binds: no window, no bounded cache, exports stay open
    assert _windows(MistralConfig(num_hidden_layers=2, max_position_embeddings=4096)) == [None, None]
    assert _windows(Qwen2Config(num_hidden_layers=3)) == [None] * 3  # use_sliding_window off
    assert _windows(Qwen2Config(num_hidden_layers=3, use_sliding_window=True, sliding_window=64,
                                max_window_layers=1)) == [None, 64, 64]
    assert _windows(Qwen3Config(num_hidden_layers=2, use_sliding_window=True, sliding_window=64,
                                max_window_layers=0)) == [64, 64]
    assert _windows(LlamaConfig(num_hidden_layers=2)) == [None, None]


@pytest.mark.parametrize("family", sorted(SLIDING))
def test_lossless_keeps_the_window(family, tmp_path):
    """Through files, prompts 4x the window: prefill logits (expanded and absorbed) and greedy decode
    one token at a time through the latent cache, every step equal to the source's (fp32, 1e-5); the
    same weights without the window give other logits, so the window is what is being matched."""
    settings, windows = SLIDING[family]
    source = make_tiny_model(family, tmp_path / "src", **HEAD, **settings)
    unwindowed = make_tiny_model(family, None, **HEAD, **{**settings, "sliding_window": None})
    out = tmp_path / "mla"
    convert(str(tmp_path / "src"), out, ConvertOptions.of(method="lossless"), progress=False)
    assert json.loads((out / "config.json").read_text())["mla"]["sliding_windows"] == windows
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = random_ids(0)
    with torch.no_grad():
        want = source(ids).logits
        assert not torch.allclose(want, unwindowed(ids).logits, rtol=1e-3, atol=1e-3)
        for mode in ("expanded", "absorbed"):
            transmla.mla.model.set_decode_mode(model, mode)
            assert_logits_close(model(ids).logits, want)
    transmla.mla.model.set_decode_mode(model, "auto")
    assert_kernel_decode_equals_source(model, source, ids, prompt=16, steps=8)


def test_exports_refuse_a_sliding_window(tmp_path):
    """Before converting (`convert --format deepseek`: nothing written) and on a converted model."""
    from transmla.export.deepseek import ExportOptions, export_deepseek
    from transmla.export.gguf import export_gguf

    settings, _ = SLIDING["mistral"]
    make_tiny_model("mistral", tmp_path / "src", **HEAD, **settings)
    with pytest.raises(ExportError, match="sliding window") as refused:
        convert(str(tmp_path / "src"), tmp_path / "ds", ConvertOptions.of(method="lossless", format="deepseek"),
                progress=False)
    assert "\n" not in str(refused.value) and not (tmp_path / "ds").exists()
    convert(str(tmp_path / "src"), tmp_path / "mla", ConvertOptions.of(method="lossless"), progress=False)
    with pytest.raises(ExportError, match="sliding window"):
        export_deepseek(tmp_path / "mla", tmp_path / "ds", ExportOptions(), progress=False)
    with pytest.raises(ExportError, match="sliding window"):
        export_gguf(tmp_path / "mla", tmp_path / "mla.gguf", progress=False)
    assert not (tmp_path / "ds").exists() and not (tmp_path / "mla.gguf").exists()
