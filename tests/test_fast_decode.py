"""The CPU fast path (LatentCache + fused one-KV-head SDPA) equals the reference decode and the
expanded attention, through generate() for several steps, padded batches included; the cache
holds exactly d_c + d_r values per token per layer, preallocated for the whole generation."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, DynamicCache

from transmla.eval.kv import cache_elements
from transmla.mla.config import MLAConfig
from transmla.mla.kernels.backends import attend_rows
from transmla.mla.kernels.reference import mla_decode_reference
from transmla.mla.latent_cache import LatentCache, LatentLayer
from transmla.mla.model import build_mla_model, mla_config_for, set_decode_mode

D_C, D_R = 10, 6


def random_mla_model(tiny_factory, bias: bool = False, narrow_latent: bool = False, d_c: int = D_C, d_r: int = D_R):
    """A random MLA model over the tiny llama geometry (6 heads, 2 layers, hidden 48), d_c = 10, d_r = 6 by default;
    narrow_latent: d_c <= d_nope and d_c <= d_v, so a prefill of >= 48 tokens folds W_UK / W_UV into the weights."""
    _, path = tiny_factory("llama")
    config = AutoConfig.from_pretrained(path)
    d_nope, d_v = (d_c + 2, d_c) if narrow_latent else (5, 7)
    freqs = [0.5 ** i for i in range(d_r // 2)]
    mla = MLAConfig(num_heads=6, hidden_size=48, kv_lora_rank=d_c, qk_rope_head_dim=d_r, qk_nope_head_dim=d_nope,
                    v_head_dim=d_v, softmax_scale=0.4, rope_inv_freq=[freqs] * 2, kv_a_norm=True,
                    q_bias=bias, kv_a_bias=bias, kv_b_bias=bias, o_bias=bias)
    config._attn_implementation = "sdpa"
    torch.manual_seed(1)
    model = build_mla_model(mla_config_for(config, mla)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "self_attn" in name:
                p.normal_(0, 0.4)
    return model


def reference_logits(model, sequences: torch.Tensor) -> torch.Tensor:
    """Last-position logits of a full causal pass without a cache (expanded attention)."""
    set_decode_mode(model, "expanded")
    try:
        return model(sequences, use_cache=False).logits[:, -1]
    finally:
        set_decode_mode(model, "auto")


@pytest.mark.parametrize("bias,narrow_latent,prompt_len", [(False, False, 11), (True, False, 11), (False, True, 20),
                                                             (True, True, 20)])
def test_generate_fast_path_equals_full_forward(tiny_factory, bias, narrow_latent, prompt_len):
    """narrow_latent with a 3 x 20 prompt: the prefill takes the folded-weights path."""
    model = random_mla_model(tiny_factory, bias, narrow_latent)
    prompt = torch.randint(0, 97, (3, prompt_len))
    attn = model.model.layers[0].self_attn
    assert attn._folds(*prompt.shape) == narrow_latent
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        assert isinstance(out.past_key_values, LatentCache)
        for step, logits in enumerate(out.logits):
            ref = reference_logits(model, out.sequences[:, : prompt.shape[1] + step])
            torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)


def test_generate_fast_path_equals_reference_kernel_decode(tiny_factory):
    """Same greedy steps through the old path: a DynamicCache and the reference kernel per layer."""
    model = random_mla_model(tiny_factory)
    prompt = torch.randint(0, 97, (2, 9))
    kwargs = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        fast = model.generate(prompt, **kwargs)
        set_decode_mode(model, "expanded")
        slow = model.generate(prompt, past_key_values=DynamicCache(config=model.config), **kwargs)
    assert torch.equal(fast.sequences, slow.sequences)
    for a, b in zip(fast.logits, slow.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("narrow_latent,length", [(False, 10), (True, 30)])
def test_generate_padded_batch_equals_each_sequence_alone(tiny_factory, narrow_latent, length):
    """narrow_latent with 2 x 30 tokens: the padded prefill takes the folded-weights path."""
    model = random_mla_model(tiny_factory, narrow_latent=narrow_latent)
    assert model.model.layers[0].self_attn._folds(2, length) == narrow_latent
    long, short = torch.randint(0, 97, (1, length)), torch.randint(0, 97, (1, length - 4))
    pad = 0
    ids = torch.cat([long, torch.cat([torch.full((1, 4), pad), short], dim=1)])  # left-padded [2, length]
    mask = torch.cat([torch.ones(1, length), torch.cat([torch.zeros(1, 4), torch.ones(1, length - 4)], dim=1)]).long()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=pad)
        assert isinstance(out.past_key_values, LatentCache)
        for row, (prompt, start) in enumerate([(long, 0), (short, 4)]):
            for step, logits in enumerate(out.logits):
                seq = out.sequences[row : row + 1, start : ids.shape[1] + step]
                torch.testing.assert_close(logits[row : row + 1], reference_logits(model, seq), atol=1e-5, rtol=1e-5)


def test_latent_cache_holds_d_c_plus_d_r_per_token_preallocated(tiny_factory):
    model = random_mla_model(tiny_factory)
    batch, prompt, new = 2, 7, 4
    with torch.no_grad():
        ids = torch.randint(0, 97, (batch, prompt))
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, return_dict_in_generate=True, pad_token_id=0)
    cache = out.past_key_values
    tokens = prompt + new - 1  # the last generated token is never fed back
    layers = model.config.num_hidden_layers
    assert cache.get_seq_length() == tokens
    assert cache_elements(cache) == batch * tokens * (D_C + D_R) * layers
    for layer in cache.layers:
        assert layer.rows.shape == (batch, tokens, D_C + D_R)  # sized once by generate(), exactly, never grown
        assert layer.keys.shape == (batch, 1, tokens, D_C) and layer.values.shape == (batch, 1, tokens, D_R)


def test_latent_layer_appends_in_place_and_grows_by_doubling():
    layer = LatentLayer(capacity=4)
    c, r = torch.randn(2, 3, D_C), torch.randn(2, 3, D_R)
    rows = layer.append(c, r)
    buffer = layer.rows.data_ptr()
    assert rows.shape == (2, 3, D_C + D_R) and rows.data_ptr() == buffer
    c2, r2 = torch.randn(2, 1, D_C), torch.randn(2, 1, D_R)
    layer.append(c2, r2)
    assert layer.rows.data_ptr() == buffer and layer.capacity == 4  # written in place
    c3, r3 = torch.randn(2, 2, D_C), torch.randn(2, 2, D_R)
    rows = layer.append(c3, r3)
    assert layer.capacity == 8 and layer.get_seq_length() == 6
    torch.testing.assert_close(rows, torch.cat([torch.cat(p, -1) for p in ((c, r), (c2, r2), (c3, r3))], dim=1))
    layer.crop(-2)
    assert layer.get_seq_length() == 4 and layer.keys.shape == (2, 1, 4, D_C)
    layer.batch_select_indices(torch.tensor([1]))
    torch.testing.assert_close(layer.filled_rows(), torch.cat([torch.cat((c, r), -1), torch.cat((c2, r2), -1)], 1)[1:])


@pytest.mark.parametrize("t_q", [1, 3, 12])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_attend_rows_equals_reference_kernel(t_q, dtype, tol):
    torch.manual_seed(0)
    B, H, S = 2, 5, 40
    q_lat, q_rope = torch.randn(B, t_q, H, D_C), torch.randn(B, t_q, H, D_R)
    latent, rope_key = torch.randn(B, S, D_C), torch.randn(B, S, D_R)
    ref = mla_decode_reference(q_lat, q_rope, latent, rope_key, 0.3)
    rows = torch.cat((latent, rope_key), -1).to(dtype)
    q_rows = torch.cat((q_lat, q_rope), -1).to(dtype)
    out = attend_rows(q_rows, rows, D_C, 0.3)
    assert out.dtype == dtype and out.shape == (B, t_q, H, D_C)
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    # a padding mask (sequence 1 starts at position 7) equals the reference with those rows hidden
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[1, :7] = False
    causal = torch.arange(S)[None, :] <= (torch.arange(t_q)[:, None] + S - t_q)
    mask = (keep[:, None, :] & causal[None])[:, None]  # [B, 1, T, S]
    masked = attend_rows(q_rows, rows, D_C, 0.3, mask)
    ref1 = mla_decode_reference(q_lat[1:], q_rope[1:], latent[1:, 7:], rope_key[1:, 7:], 0.3)
    torch.testing.assert_close(masked[1:].float(), ref1, atol=tol, rtol=tol)
    torch.testing.assert_close(masked[:1].float(), ref[:1], atol=tol, rtol=tol)
