"""Gemma 3 (text): tiny random models built with transformers' own Gemma3 classes.

What the family brings (families/gemma3.py) and the native MLA model keeps: QK-norm with (1 + w)
weights (the key norm applied when a cache row is written), the softmax scale
1/sqrt(query_pre_attn_scalar), sliding-window layers beside global ones with their own RoPE bases,
the embedding scale, the source's own decoder layer with its extra norms and GELU-tanh MLP, tied
embeddings. Prompts are longer than the window, so the window shows in prefill and in decode.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from conftest import assert_kernel_decode_equals_source, assert_logits_close, perplexity, random_ids

import transmla  # noqa: F401  (registers the MLA models)
from transmla.convert.api import convert
from transmla.convert.options import ConvertOptions
from transmla.families import UnsupportedArchitectureError, family_for
from transmla.mla.latent_cache import cache_kwargs
from transmla.mla.window import sliding_window

# head_dim 16 (not hidden / heads = 8); cache rows 2*2*16 = 64 wide: a shape the CPU decode kernel takes.
# query_pre_attn_scalar 24 != head_dim, window 6 < the prompts, layers sliding/full/sliding with rope
# bases 10k / 1M (Gemma3TextConfig's defaults for the two kinds).
G, D_HEAD, H, WINDOW = 2, 16, 6, 6
GEMMA3 = dict(head_dim=D_HEAD, initializer_range=0.2, query_pre_attn_scalar=24, sliding_window=WINDOW,
              num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
              tie_word_embeddings=True)


def test_family_specifics():
    config = Gemma3TextConfig(**GEMMA3)
    family = family_for(config)
    assert family.qk_norm and family.qk_norm_offset == 1.0
    assert family.scale(config) == 24**-0.5
    assert [family.window(config, i) for i in range(3)] == [WINDOW, None, WINDOW]
    local, glob = family.rope(config, 0)[0], family.rope(config, 1)[0]
    assert float(local[1]) == pytest.approx(10_000 ** (-2 / D_HEAD)) and float(glob[1]) == pytest.approx(1e6 ** (-2 / D_HEAD))
    assert family.embedding_scale(config) == config.hidden_size**0.5
    with pytest.raises(UnsupportedArchitectureError, match="attn_logit_softcapping"):
        family_for(Gemma3TextConfig(**GEMMA3, attn_logit_softcapping=50.0))


def test_sliding_window_mask():
    start, mask = sliding_window(None, 3, 10, 4, "cpu")  # queries at 7, 8, 9 see 4..7, 5..8, 6..9
    assert start == 4
    assert mask[0, 0].tolist() == [[True, True, True, True, False, False],
                                   [False, True, True, True, True, False],
                                   [False, False, True, True, True, True]]
    assert sliding_window(None, 1, 10, 4, "cpu") == (6, None)  # decode: the window's rows, no mask
    assert sliding_window(None, 3, 4, 4, "cpu") == (0, None)  # shorter than the window: unchanged


@pytest.mark.parametrize("bias", [False, True])
def test_lossless_prefill_and_decode_equal_source(tiny_factory, tmp_path, bias):
    """Through files: prefill logits over prompts 4x the window, then greedy decode one token at a
    time through the latent cache (the CPU decode kernel over each sliding layer's window), every
    step equal to the source's logits (fp32, 1e-5 relative); saved again and reloaded, the same."""
    source, path = tiny_factory("gemma3_text", bias=bias, **GEMMA3)
    out = tmp_path / "mla"
    result = convert(str(path), out, ConvertOptions.of(method="lossless"), progress=False)
    assert result.kv_elements_per_token_per_layer == result.source_kv_elements_per_token_per_layer == 2 * G * D_HEAD
    mla = json.loads((out / "config.json").read_text())["mla"]
    assert mla["sliding_windows"] == [WINDOW, 0, WINDOW] and mla["qk_norm_offset"] == 1.0
    assert mla["softmax_scale"] == 24**-0.5 and mla["rope_inv_freq"][0] != mla["rope_inv_freq"][1]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = random_ids(0)
    for mode in ("expanded", "absorbed"):
        transmla.mla.model.set_decode_mode(model, mode)
        with torch.no_grad():
            assert_logits_close(model(ids).logits, source(ids).logits)
    transmla.mla.model.set_decode_mode(model, "auto")
    assert_kernel_decode_equals_source(model, source, ids, prompt=16, steps=8)
    model.save_pretrained(tmp_path / "again")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again", dtype=torch.float32).eval()
    with torch.no_grad():
        assert_logits_close(again(ids).logits, source(ids).logits)


def test_sliding_layer_applies_its_own_window(tiny_factory, tmp_path):
    """A sliding layer's MLA attention keeps its window without any mask from the model: prefill in
    both forms and decode one token at a time through a LatentCache, where the CPU decode kernel
    reads exactly the window's rows; equal to the source attention under its sliding mask."""
    from transmla.mla import model as mla_model
    from transmla.mla.kernels import cpu_decode
    from transmla.mla.latent_cache import LatentCache

    source, path = tiny_factory("gemma3_text", **GEMMA3)
    convert(str(path), tmp_path / "mla", ConvertOptions.of(method="lossless"), progress=False)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "mla", dtype=torch.float32).eval()
    T = 20
    x = torch.randn(2, T, 48, generator=torch.Generator().manual_seed(5))
    pos = torch.arange(T)[None]
    band = sliding_window(None, T, T, WINDOW, "cpu")[1]  # [1, 1, T, T]
    with torch.no_grad():
        cos_sin = source.model.rotary_emb(x, pos, "sliding_attention")
        want = source.model.layers[0].self_attn(x, position_embeddings=cos_sin,
                                                attention_mask=torch.zeros(band.shape).masked_fill(~band, -torch.inf))[0]
        attn = model.model.layers[0].self_attn
        for mode in ("expanded", "absorbed"):
            mla_model.set_decode_mode(model, mode)
            assert_logits_close(attn(x, position_ids=pos)[0], want)
        mla_model.set_decode_mode(model, "auto")
        read, original = [], cpu_decode.mla_decode_cpu

        def counted(q_rows, rows, d_c, scale):
            read.append(rows.shape[1])
            return original(q_rows, rows, d_c, scale)

        cache = LatentCache(3)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cpu_decode, "mla_decode_cpu", counted)
            attn(x[:, :12], position_ids=pos[:, :12], **cache_kwargs(cache))
            steps = [attn(x[:, t : t + 1], position_ids=pos[:, t : t + 1], **cache_kwargs(cache))[0] for t in range(12, T)]
    assert_logits_close(torch.cat(steps, dim=1), want[:, 12:])
    assert read == [WINDOW] * (T - 12)


def test_methods_at_half_cache(tiny_factory, tmp_path):
    """TransMLA and MHA2MLA at 50% of the cache run on a tiny Gemma 3 (calibrated on prompts longer
    than the window) and are measured on random text against the source."""
    from transformers import AutoConfig

    from transmla.convert.pipeline import LayerStream, write_mla_checkpoint
    from transmla.convert.registry import get_method

    source, path = tiny_factory("gemma3_text", **GEMMA3)
    config = AutoConfig.from_pretrained(path)
    calib, ids = random_ids(1, 8, 32), random_ids(2, 4, 32)
    ppl = {"source": perplexity(source, ids)}
    for method, flat in (("lossless", {}), ("transmla", {"kv_budget": 0.5, "fit_steps": 20}), ("mha2mla", {"kv_budget": 0.5, "rope_select": "2norm"})):
        options = ConvertOptions.of(method=method, device="cpu", **flat)
        layers = LayerStream(get_method(method), path, config, options, progress=False, calib_ids=calib)
        result = write_mla_checkpoint(path, config, tmp_path / method, layers, layers.record, progress=False)
        assert result.kv_elements_per_token_per_layer == (2 if method == "lossless" else 1) * G * D_HEAD
        ppl[method] = perplexity(AutoModelForCausalLM.from_pretrained(tmp_path / method, dtype=torch.float32).eval(), ids)
    print("gemma3 tiny perplexity on random text:", ppl)
    assert all(math.isfinite(v) for v in ppl.values())
    assert ppl["lossless"] == pytest.approx(ppl["source"], rel=1e-5)
