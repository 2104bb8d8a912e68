"""Qwen3 (QK-norm): tiny random models built with transformers' own Qwen3 classes.

The key norm is applied when a cache row is written and the query norm on the query side
(convert/qk_norm.py): lossless equals the source in prefill and token-by-token decode through the
latent cache (the CPU decode kernel), the methods' statistics are moments of the normed keys, the
checkpoint round-trips, and the export targets refuse with the reason.
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3Config

from conftest import assert_kernel_decode_equals_source, assert_logits_close, perplexity, random_ids

import transmla  # noqa: F401  (registers the MLA models)
from transmla.convert.api import convert
from transmla.convert.calibrate import collect_layer_stats
from transmla.convert.layers import source_layers
from transmla.convert.options import ConvertOptions
from transmla.convert.pipeline import LayerStream, write_mla_checkpoint
from transmla.convert.qk_norm import linear_source
from transmla.convert.registry import get_method
from transmla.convert.transmla.method import LayerMoments, TransMLAPlan
from transmla.export.errors import ExportError
from transmla.families import family_for
from transmla.mla.latent_cache import cache_kwargs

# head_dim 16 differs from hidden_size / heads = 8; cache rows 2*2*16 = 64 wide, latent 32: what
# the CPU decode kernel takes (multiples of 16)
G, D_HEAD, H = 2, 16, 6
QWEN3 = dict(head_dim=D_HEAD, initializer_range=0.2)  # logits of a few units, so errors show


def test_family_detected_and_sliding_layers_mapped():
    assert family_for(Qwen3Config(**QWEN3)).qk_norm == {"q_norm": "q_norm", "k_norm": "k_norm"}
    sliding = Qwen3Config(use_sliding_window=True, sliding_window=16, max_window_layers=1, num_hidden_layers=2)
    assert [family_for(sliding).window(sliding, i) for i in range(2)] == [None, 16]  # tests/test_family_windows.py


@pytest.mark.parametrize("bias", [False, True])
def test_lossless_prefill_and_decode_equal_source(tiny_factory, tmp_path, bias):
    """Through files: prefill logits, then greedy decode one token at a time through the latent
    cache with the CPU decode kernel, every step equal to the source's logits (fp32, 1e-5 relative)."""
    source, path = tiny_factory("qwen3", bias=bias, **QWEN3)
    out = tmp_path / "mla"
    result = convert(str(path), out, ConvertOptions.of(method="lossless"), progress=False)
    assert result.kv_elements_per_token_per_layer == result.source_kv_elements_per_token_per_layer == 2 * G * D_HEAD
    mla = json.loads((out / "config.json").read_text())["mla"]
    assert (mla["qk_norm_kv_heads"], mla["qk_norm_head_dim"], mla["qk_norm_bias"]) == (G, D_HEAD, bias)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    attn = model.model.layers[0].self_attn
    assert attn.kv_a_proj.in_features == G * D_HEAD + 48 and attn.q_proj.in_features == H * D_HEAD
    ids = random_ids(0)
    with torch.no_grad():
        assert_logits_close(model(ids).logits, source(ids).logits)
    assert_kernel_decode_equals_source(model, source, ids, prompt=8, steps=6)


def test_methods_at_half_cache_and_their_statistics(tiny_factory, tmp_path):
    """TransMLA and MHA2MLA at 50% of the cache run on a Qwen3 and are measured on random text
    against the source; both are exact with every key dim kept as rope at full rank; their key
    statistics are moments of the normed keys."""
    source, path = tiny_factory("qwen3", **QWEN3)
    config = AutoConfig.from_pretrained(path)
    calib = random_ids(1, 8, 32)
    # the gram is of [q~; k~; x; 1]: its key moment is E[k~ k~^T] of the source's own normed keys
    stats = collect_layer_stats(path, config, calib, progress=False)
    src = next(iter(source_layers(path, config)))
    assert stats[0].gram.shape == (H * D_HEAD + G * D_HEAD + 48 + 1,) * 2
    layer = source.model.layers[0]
    with torch.no_grad():
        x = layer.input_layernorm(source.model.embed_tokens(calib))
        k = layer.self_attn.k_norm(layer.self_attn.k_proj(x).view(*x.shape[:2], G, D_HEAD)).reshape(-1, G * D_HEAD)
    key = LayerMoments.of(linear_source(src), stats[0].gram).key
    torch.testing.assert_close(key, (k.T.double() @ k.double()) / k.shape[0], atol=1e-6, rtol=1e-6)

    def run(method, name, plan=None, fit_steps=0, **flat):
        options = ConvertOptions.of(method=method, device="cpu", fit_steps=fit_steps, **flat)
        layers = LayerStream(get_method(method), path, config, options, progress=False, calib_ids=calib, plan=plan)
        result = write_mla_checkpoint(path, config, tmp_path / name, layers, layers.record, progress=False)
        return AutoModelForCausalLM.from_pretrained(tmp_path / name, dtype=torch.float32).eval(), result

    ids = random_ids(2, 4, 64)
    full = TransMLAPlan(kv_lora_rank=G * D_HEAD, rope_dim=G * D_HEAD, freqfold=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cache does not shrink here, by design
        exact_t, _ = run("transmla", "transmla-full", plan=full)
        exact_m, _ = run("mha2mla", "mha2mla-full", rope_pairs=D_HEAD // 2, kv_lora_rank=G * D_HEAD, rope_select="2norm")
    with torch.no_grad():
        for model in (exact_t, exact_m):
            assert_logits_close(model(ids).logits, source(ids).logits)
    lossless, _ = run("lossless", "lossless")
    half_t, res_t = run("transmla", "transmla-50", fit_steps=20, kv_budget=0.5)  # the fit trains through the pre-maps
    half_m, res_m = run("mha2mla", "mha2mla-50", kv_budget=0.5, rope_select="2norm")
    assert res_t.cache_ratio == res_m.cache_ratio == 0.5
    ppl = {name: perplexity(m, ids) for name, m in
           (("source", source), ("lossless", lossless), ("transmla-full", exact_t), ("transmla-50", half_t),
            ("mha2mla-50", half_m))}
    print("qwen3 tiny perplexity on random text:", ppl)
    assert all(math.isfinite(v) for v in ppl.values())
    assert ppl["lossless"] == pytest.approx(ppl["source"], rel=1e-5)
    assert ppl["transmla-full"] == pytest.approx(ppl["source"], rel=1e-5)
    with torch.no_grad():  # absorbed decode over the latent cache agrees with the full forward
        logits = half_t(ids[:2]).logits
        past = half_t(ids[:2, :-1], use_cache=True).past_key_values
        step = half_t(ids[:2, -1:], **cache_kwargs(past), use_cache=True).logits
    torch.testing.assert_close(step[:, -1], logits[:, -1], atol=1e-4, rtol=1e-4)


def test_reload_inspect_and_exports_refuse(tiny_factory, tmp_path, cli):
    source, path = tiny_factory("qwen3", **QWEN3)
    out = tmp_path / "mla"
    convert(str(path), out, ConvertOptions.of(method="lossless"), progress=False)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    model.save_pretrained(tmp_path / "again")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again", dtype=torch.float32).eval()
    ids = random_ids(3)
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model(ids).logits, atol=0, rtol=0)
    edited = json.loads((out / "config.json").read_text())  # a hand-edited config names the QK-norm fields
    edited["mla"]["qk_norm_head_dim"] = 8
    from transmla.checkpoint.shapes import describe_shape_mismatch

    line = describe_shape_mismatch(out, AutoConfig.for_model(edited.pop("model_type"), **edited))
    assert "self_attn.k_norm.weight is [16]" in line and "mla.qk_norm_head_dim = 8" in line, line
    code, stdout, _ = cli("inspect", out, "--json")
    assert code == 0 and "key norm is applied when a cache row is written" in json.loads(stdout)["qk_norm"]
    code, stdout, _ = cli("inspect", path, "--json")
    assert code == 0 and "qk_norm" in json.loads(stdout)

    from transmla.export.deepseek import ExportOptions, export_deepseek
    from transmla.export.gguf import export_gguf

    with pytest.raises(ExportError, match="k_norm") as refused:
        export_deepseek(out, tmp_path / "ds", ExportOptions(), progress=False)
    assert "\n" not in str(refused.value)
    with pytest.raises(ExportError, match="k_norm"):
        export_gguf(out, tmp_path / "mla.gguf", progress=False)
    code, _, err = cli("convert", path, tmp_path / "ds2", "--format", "deepseek")
    assert code != 0 and "k_norm" in err and not (tmp_path / "ds2").exists()
