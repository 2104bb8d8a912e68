"""MLAAttention: absorbed decode equals the expanded path; the latent cache holds d_c + d_r per token."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from transmla.mla.attention import MLAAttention
from transmla.eval.kv import cache_elements
from transmla.mla.config import MLAConfig
from transmla.mla.model import build_mla_model, mla_config_for, set_decode_mode
from transmla.convert.assemble import assemble_model
from transmla.convert.replicate import replicate
from transmla.convert.layers import source_layers
from transformers import AutoConfig


def random_mla_config(bias: bool, q_lora: int | None = None, kv_norm: bool = False, d_r: int = 8,
                      d_c: int = 12) -> MLAConfig:
    torch.manual_seed(0)
    return MLAConfig(
        num_heads=4, hidden_size=32, kv_lora_rank=d_c, qk_rope_head_dim=d_r, qk_nope_head_dim=6, v_head_dim=10,
        softmax_scale=0.3, rope_inv_freq=[torch.rand(d_r // 2).tolist()], q_lora_rank=q_lora, q_a_norm=bool(q_lora),
        kv_a_norm=kv_norm, q_bias=bias, kv_a_bias=bias, kv_b_bias=bias, o_bias=bias,
    )


def randomize(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.3)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("q_lora,kv_norm", [(None, False), (7, True)])
def test_absorbed_equals_expanded_layer(bias, q_lora, kv_norm):
    config = random_mla_config(bias, q_lora, kv_norm)
    attn = MLAAttention(config, 0).eval()
    randomize(attn)
    x = torch.randn(2, 9, 32)
    outs = {}
    for mode in ("expanded", "absorbed"):
        config.decode = mode
        cache = DynamicCache()
        prefill, _ = attn(x[:, :5], past_key_values=cache, position_ids=torch.arange(5)[None])
        steps = [attn(x[:, t : t + 1], past_key_values=cache, position_ids=torch.tensor([[t]]))[0] for t in range(5, 9)]
        outs[mode] = torch.cat([prefill, *steps], dim=1)
    torch.testing.assert_close(outs["absorbed"], outs["expanded"], atol=1e-5, rtol=1e-5)
    # And both equal one full causal pass without a cache.
    config.decode = "expanded"
    full, _ = attn(x, position_ids=torch.arange(9)[None])
    torch.testing.assert_close(outs["expanded"], full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("q_lora,kv_norm", [(None, False), (7, True)])
@pytest.mark.parametrize("padded", [False, True])
def test_folded_prefill_equals_expanded_layer(bias, q_lora, kv_norm, padded):
    """d_c = 5 <= d_nope, d_v and 2 x 20 tokens >= hidden 32: the absorbed prefill folds W_UK into the
    query linear and W_UV into o_proj; equal to the expanded path, and so are the decode steps after it."""
    config = random_mla_config(bias, q_lora, kv_norm, d_c=5)
    attn = MLAAttention(config, 0).eval()
    randomize(attn)
    x = torch.randn(2, 23, 32)
    mask = None
    if padded:  # sequence 1 is left-padded by 3 tokens: a boolean [B, 1, T, S] mask, True = attend
        keep = torch.ones(2, 23, dtype=torch.bool)
        keep[1, :3] = False
        mask = (keep[:, None, :] & torch.ones(23, 23, dtype=torch.bool).tril()[None])[:, None]
    assert attn._folds(2, 20) and not attn._folds(2, 1)
    outs = {}
    for mode in ("expanded", "absorbed"):
        config.decode = mode
        cache = DynamicCache()
        prefill, _ = attn(x[:, :20], attention_mask=None if mask is None else mask[..., :20, :20],
                          past_key_values=cache, position_ids=torch.arange(20)[None])
        steps = [attn(x[:, t : t + 1], attention_mask=None if mask is None else mask[..., t : t + 1, : t + 1],
                      past_key_values=cache, position_ids=torch.tensor([[t]]))[0] for t in range(20, 23)]
        outs[mode] = torch.cat([prefill, *steps], dim=1)
    first = 3 if padded else 0  # the padding positions' own queries see nothing: not compared
    torch.testing.assert_close(outs["absorbed"][0], outs["expanded"][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs["absorbed"][1, first:], outs["expanded"][1, first:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family,bias,kv_heads", [("llama", False, 2), ("llama", True, 6), ("qwen2", True, 2), ("mistral", False, 6)])
def test_generate_absorbed_matches_prefill_logits(tiny_factory, family, bias, kv_heads):
    """Converted model: every greedy step's logits through the absorbed latent cache equal a fresh
    full forward (expanded path, no cache) over the same tokens. MHA (6 KV heads) and GQA (2)."""
    _, path = tiny_factory(family, bias=bias, num_key_value_heads=kv_heads)
    config = AutoConfig.from_pretrained(path)
    model = assemble_model(path, config, [replicate(s) for s in source_layers(path, config)])
    set_decode_mode(model, "absorbed")
    prompt = torch.randint(0, 97, (1, 6))
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
        set_decode_mode(model, "expanded")
        for step, logits in enumerate(out.logits):
            seq = out.sequences[:, : prompt.shape[1] + step]
            ref = model(seq, use_cache=False).logits[:, -1]
            torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-4)


def test_latent_cache_size_equals_formula(tiny_factory):
    _, path = tiny_factory("llama")
    config = AutoConfig.from_pretrained(path)
    model = assemble_model(path, config, [replicate(s) for s in source_layers(path, config)])
    mla = model.config.mla
    batch, prompt, new = 2, 7, 4
    with torch.no_grad():
        out = model.generate(torch.randint(0, 97, (batch, prompt)), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, return_dict_in_generate=True)
    tokens = prompt + new - 1  # the last generated token is never fed back
    per_token_layer = mla["kv_lora_rank"] + mla["qk_rope_head_dim"]
    assert cache_elements(out.past_key_values) == batch * tokens * per_token_layer * config.num_hidden_layers
    assert per_token_layer == 2 * config.num_key_value_heads * config.head_dim  # lossless: same as the source


def test_build_mla_model_from_config_round_trip(tmp_path, tiny_factory):
    _, path = tiny_factory("llama")
    config = AutoConfig.from_pretrained(path)
    mla = MLAConfig(num_heads=6, hidden_size=48, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                    softmax_scale=0.35, rope_inv_freq=[[1.0, 0.1]] * 2)
    model = build_mla_model(mla_config_for(config, mla))
    model.save_pretrained(tmp_path / "m")
    import transmla  # noqa: F401  (registers the Auto classes)
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert loaded.config.mla["rope_inv_freq"] == [[1.0, 0.1]] * 2
    ids = torch.randint(0, 97, (1, 5))
    torch.testing.assert_close(loaded(ids).logits, model.eval()(ids).logits)


def test_config_rejects_odd_rope_dims():
    with pytest.raises(ValueError, match="even"):
        MLAConfig(num_heads=1, hidden_size=4, kv_lora_rank=2, qk_rope_head_dim=3, qk_nope_head_dim=1, v_head_dim=1,
                  softmax_scale=1.0, rope_inv_freq=[[1.0]])


@pytest.mark.parametrize("masked", [False, True])
def test_expanded_values_padded_to_key_width_change_nothing(monkeypatch, masked):
    """From PAD_VALUES_MIN_ROWS key rows on, the CPU expanded path pads values (d_v 10) to the keys'
    width (d_qk 14) for SDPA's fused kernel: outputs and gradients equal the unpadded path's."""
    import transmla.mla.attention as attention

    config = random_mla_config(bias=True)
    config.decode = "expanded"
    attn = MLAAttention(config, 0).train()
    randomize(attn)
    x = torch.randn(2, 40, 32)
    mask = None
    if masked:  # the second sequence left-padded by 7 tokens: a boolean [B, 1, T, S] mask
        keep = torch.ones(2, 40, dtype=torch.bool)
        keep[1, :7] = False
        mask = torch.tril(torch.ones(40, 40, dtype=torch.bool))[None, None] & keep[:, None, None, :]
    results = {}
    for rows in (10**9, 16):  # never padded, padded
        monkeypatch.setattr(attention, "PAD_VALUES_MIN_ROWS", rows)
        attn.zero_grad()
        out, _ = attn(x, attention_mask=mask, position_ids=torch.arange(40)[None])
        out[:, 8:].pow(2).sum().backward()  # the rows every mask leaves whole
        results[rows] = (out[:, 8:].detach(), [p.grad.clone() for p in attn.parameters()])
    (out_a, grads_a), (out_b, grads_b) = results.values()
    torch.testing.assert_close(out_b, out_a, atol=1e-5, rtol=1e-5)
    for ga, gb in zip(grads_a, grads_b):  # fp32 sums in another order: relative to each gradient's size
        assert float((gb - ga).norm() / ga.norm()) < 1e-5


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("q_lora,kv_norm", [(None, False), (7, True)])
def test_outputs_at_equals_the_expanded_forward_with_gradients(bias, q_lora, kv_norm):
    """outputs_at (the fit's loss on sampled queries, absorbed: attend_rows_differentiable) equals the expanded forward at
    those positions, values and gradients of every parameter (kv_b_proj's V bias included), fp32."""
    config = random_mla_config(bias, q_lora, kv_norm)
    config.decode = "expanded"
    attn = MLAAttention(config, 0).eval()
    randomize(attn)
    x = torch.randn(2, 11, 32)
    at = torch.tensor([0, 4, 5, 10])
    weight = torch.randn(2, 4, 32)
    params = list(attn.parameters())
    full = attn(x, position_ids=torch.arange(11)[None])[0][:, at]
    sampled = attn.outputs_at(x, at)
    torch.testing.assert_close(sampled, full, atol=1e-5, rtol=1e-5)
    want = torch.autograd.grad((full * weight).sum(), params)
    got = torch.autograd.grad((sampled * weight).sum(), params)
    for (name, _), g, w in zip(attn.named_parameters(), got, want):
        torch.testing.assert_close(g, w, atol=1e-5 * float(w.abs().max().clamp_min(1)), rtol=1e-5, msg=lambda m: f"{name}: {m}")


def test_absorbed_loss_scores_in_float32_under_bf16_autocast():
    """Under bf16 autocast the fit's absorbed attention (attend_rows_differentiable) takes its scores' product in
    float32 (as SDPA's flash kernel does): from the same bf16 inputs it gives what float32 scores give, a softmax in
    float32 and the read-back in bf16, where bf16-rounded scores move the result at large scores."""
    from transmla.mla.attention import attend_rows_differentiable

    torch.manual_seed(0)
    B, m, H, T, d_c, W = 2, 5, 3, 40, 12, 16
    q_rows = (4 * torch.randn(B, m, H, W)).bfloat16()  # large scores: bf16's 8 bits lose their softmax
    rows = (4 * torch.randn(B, T, W)).bfloat16()
    mask = torch.ones(1, 1, m, T, dtype=torch.bool).tril(T - m)
    scale = 0.3
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = attend_rows_differentiable(q_rows, rows, d_c, scale, mask)
    scores = (q_rows.float() * scale).reshape(B, m * H, W) @ rows.float().transpose(1, 2)  # [B, m*H, T]
    bias = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))
    p = torch.softmax(scores.view(B, m, H, T) + bias.transpose(1, 2), dim=-1)
    want = (p.view(B, m * H, T).bfloat16() @ rows[..., :d_c]).view(B, m, H, d_c)
    torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=0.01)
    rounded = torch.softmax(scores.bfloat16().float().view(B, m, H, T) + bias.transpose(1, 2), dim=-1)
    other = (rounded.view(B, m * H, T).bfloat16() @ rows[..., :d_c]).view(B, m, H, d_c)
    assert float((other.float() - want.float()).abs().max()) > 0.05  # the check can tell the two apart


@pytest.mark.parametrize("kind", ["causal", "window", "far"])
def test_absorbed_loss_in_query_blocks_equals_one_product(kind):
    """attend_rows_differentiable takes its queries QUERY_BLOCK at a time, each block against the span of rows its
    mask reaches: the output and every gradient equal one masked product over all rows (fp64), for sorted query
    positions under a causal mask, a sliding window's band and the fit's far mask (keys far back only)."""
    from transmla.convert.output_fit import far_mask
    from transmla.mla.attention import QUERY_BLOCK, attend_rows_differentiable

    torch.manual_seed(0)
    B, H, T, d_c, W = 2, 3, 300, 12, 16
    m = 2 * QUERY_BLOCK + 22  # three blocks, the last one short
    at = torch.randperm(T - 41)[:m].sort().values + 41  # [m] sorted query positions
    j = torch.arange(T)[None, :]
    mask = {"causal": j <= at[:, None], "window": (j <= at[:, None]) & (j > at[:, None] - 50),
            "far": far_mask(T, 40)[at]}[kind][None, None]  # [1, 1, m, T]
    q_rows = torch.randn(B, m, H, W, dtype=torch.float64, requires_grad=True)
    rows = torch.randn(B, T, W, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(B, m, H, d_c, dtype=torch.float64)
    got = attend_rows_differentiable(q_rows, rows, d_c, 0.3, mask)
    scores = (q_rows * 0.3).reshape(B, m * H, W) @ rows.transpose(1, 2)  # [B, m*H, T]
    p = torch.softmax(scores.view(B, m, H, T).masked_fill(~mask.transpose(1, 2), float("-inf")), dim=-1)
    want = (p.view(B, m * H, T) @ rows[..., :d_c]).view(B, m, H, d_c)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
    for g, w in zip(torch.autograd.grad((got * weight).sum(), (q_rows, rows)),
                    torch.autograd.grad((want * weight).sum(), (q_rows, rows))):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=1e-10)
