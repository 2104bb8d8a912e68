"""MHA2MLA: pair selection, partial-RoPE layer, joint/split (activation-aware) SVD, budget, MHA copy.

Exactness ladder: every pair kept + full rank reproduces the source (fp32 ~1e-5); with pairs
dropped the layer equals an independent partial-RoPE attention; the SVD is exact at full rank
and, at equal rank, the activation-aware one is closer on the calibration data.
"""

from __future__ import annotations

import itertools
import json
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

import transmla  # noqa: F401  (registers the MLA models)
from transmla.convert.api import convert
from transmla.convert.calibrate import mla_attention, calibrated_layers
from transmla.convert.layers import SourceAttention
from transmla.convert.lowrank import with_bias_column
from transmla.convert.mha2mla.budget import default_rope_pairs, mha2mla_budget, resolve_shape
from transmla.convert.mha2mla.method import MHA2MLASettings, mha2mla_layer
from transmla.convert.mha2mla.mha_copy import make_mha_copy, repeat_kv_heads
from transmla.convert.options import ConvertOptions
from transmla.convert.mha2mla.partial_rope import (
    high_pairs,
    key_latent_dims,
    low_pairs,
    partial_rope,
    partial_rope_rows,
    select_pairs,
    top_pairs,
    two_norm_scores,
    uniform_pairs,
)
from transmla.convert.layers import source_layers
from transmla.convert.pipeline import LayerStream, write_mla_checkpoint
from transmla.convert.registry import get_method
from transmla.convert.replicate import replicate
from transmla.convert.mha2mla.svd import compress_latent, factor_latent, share_rank
from transmla.families import AttentionGeometry, attention_geometry

TOL = dict(atol=1e-5, rtol=1e-5)


# -- helpers ----------------------------------------------------------------------------------------


def _load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _ids(seed=0, batch=2, length=24, vocab=97):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def _layer0(path) -> tuple[object, SourceAttention]:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    return config, next(iter(source_layers(path, config)))


def _rotate(x: torch.Tensor, angles: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """RoPE (rotate-half) on the pairs where mask is True. x [B, T, heads, d], angles [T, d/2], mask [heads, d/2]."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    cos, sin = angles.cos()[None, :, None], angles.sin()[None, :, None]  # [1, T, 1, d/2]
    ra, rb = a * cos - b * sin, a * sin + b * cos
    m = mask[None, None]
    return torch.cat((torch.where(m, ra, a), torch.where(m, rb, b)), dim=-1)


def reference_partial_rope(src: SourceAttention, x: torch.Tensor, pairs: torch.Tensor | None) -> torch.Tensor:
    """The source attention with RoPE kept only on `pairs` [g, P] of each key head (None: all). x [B, T, D]."""
    geo = src.geometry
    H, g, d = geo.num_heads, geo.num_kv_heads, geo.head_dim
    B, T, _ = x.shape
    lin = lambda w, b: x @ w.T + (0 if b is None else b)  # noqa: E731
    q = lin(src.wq, src.bq).view(B, T, H, d)
    k = lin(src.wk, src.bk).view(B, T, g, d)
    v = lin(src.wv, src.bv).view(B, T, g, d)
    mask = torch.ones(g, d // 2, dtype=torch.bool)
    if pairs is not None:
        mask = torch.zeros(g, d // 2, dtype=torch.bool).scatter_(1, pairs, True)
    angles = torch.arange(T).float()[:, None] * src.inv_freq[None]  # [T, d/2]
    n = H // g
    q = _rotate(q, angles, mask.repeat_interleave(n, 0))
    k = _rotate(k, angles, mask).repeat_interleave(n, 2)
    v = v.repeat_interleave(n, 2)
    scores = torch.einsum("bthd,bshd->bhts", q, k) * d**-0.5
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    out = torch.einsum("bhts,bshd->bthd", scores.softmax(-1), v).reshape(B, T, H * d)
    return out @ src.wo.T + (0 if src.bo is None else src.bo)


def mla_forward(config, layer, x: torch.Tensor) -> torch.Tensor:
    attn = mla_attention(config, layer, "cpu")
    with torch.no_grad():
        return attn(x, position_ids=torch.arange(x.shape[1])[None])[0]


# -- selection ---------------------------------------------------------------------------------------


def test_fixed_strategies_pick_the_papers_pairs():
    assert high_pairs(32, 4).tolist() == [0, 1, 2, 3]  # pair 0 rotates fastest
    assert low_pairs(32, 4).tolist() == [28, 29, 30, 31]
    assert uniform_pairs(32, 4).tolist() == [0, 8, 16, 24]  # every (d/2)/P-th from 0
    assert uniform_pairs(64, 8).tolist() == list(range(0, 64, 8))
    assert uniform_pairs(32, 3).tolist() == [0, 10, 21]  # evenly spread when P does not divide d/2
    assert uniform_pairs(4, 4).tolist() == [0, 1, 2, 3]
    sel = select_pairs("low", num_kv_heads=3, head_dim=8, keep=2)
    assert sel.tolist() == [[2, 3]] * 3
    with pytest.raises(ValueError, match="cannot keep 5 rope pairs"):
        high_pairs(4, 5)
    with pytest.raises(ValueError, match="unknown rope selection"):
        select_pairs("middle", 2, 8, 2)
    with pytest.raises(ValueError, match="needs calibration pair norms"):
        select_pairs("2norm", 2, 8, 2)


def test_two_norm_scores_sum_the_groups_queries():
    # H=4 query heads, g=2 key heads (groups {0,1}, {2,3}), d/2 = 4 pairs.
    q = torch.tensor([[1.0, 0, 0, 5], [1, 0, 0, 5], [0, 9, 1, 0], [0, 9, 1, 0]])
    k = torch.tensor([[1.0, 1, 1, 0.1], [1, 0.1, 3, 1]])
    scores = two_norm_scores(q, k)
    assert torch.allclose(scores, torch.tensor([[2.0, 0, 0, 1.0], [0, 1.8, 6, 0]], dtype=torch.float64))
    # head 0 keeps pairs 0 and 3 (its queries outweigh the small k norm of pair 3), head 1 keeps 1 and 2
    assert select_pairs("2norm", 2, 8, 2, q, k).tolist() == [[0, 3], [1, 2]]
    # ties go to the higher frequency (lower index); rows come back sorted
    assert top_pairs(torch.tensor([[1.0, 1, 1, 1]]), 2).tolist() == [[0, 1]]
    assert top_pairs(torch.tensor([[0.0, 3, 1, 2]]), 3).tolist() == [[1, 2, 3]]


def test_partial_rope_rows_layout():
    rope, nope = partial_rope_rows(torch.tensor([[0, 2], [1, 3]]), head_dim=8)
    # shared key pairs p = j*4 + i: kept 0, 2 | 5, 7; second halves at +8
    assert rope.tolist() == [0, 2, 5, 7, 8, 10, 13, 15]
    # per key head: dropped pairs' first halves, then their second halves
    assert nope.tolist() == [1, 3, 9, 11, 4, 6, 12, 14]
    with pytest.raises(ValueError, match="repeat"):
        partial_rope_rows(torch.tensor([[1, 1]]), head_dim=8)


# -- the layer: partial-RoPE and SVD -----------------------------------------------------------------


@pytest.mark.parametrize("kv_heads,bias", [(2, False), (6, False), (2, True)])
def test_partial_rope_layer_equals_reference(tiny_factory, kv_heads, bias):
    _, path = tiny_factory("llama", name=f"src{kv_heads}{bias}", num_key_value_heads=kv_heads, bias=bias)
    config, src = _layer0(path)
    x = 20 * torch.randn(2, 12, src.geometry.hidden_size)  # sharp attention: every pair matters
    pairs = torch.tensor([[0, 2], [1, 3], [0, 3], [2, 3], [1, 2], [0, 1]])[:kv_heads]  # differs per key head
    layer = partial_rope(replicate(src), pairs, src.geometry.num_heads, src.geometry.head_dim)
    assert layer.kv_a_proj.shape[0] == kv_heads * (8 - 4) + kv_heads * 8 + kv_heads * 4  # K_nope + V + rope
    torch.testing.assert_close(mla_forward(config, layer, x), reference_partial_rope(src, x, pairs), **TOL)
    # a full-rank latent (joint or split, any weighting) changes nothing
    full = key_latent_dims(kv_heads, 8, 2) + kv_heads * 8
    gram = _gram(x)
    for mode, gr in itertools.product(("joint", "split"), (None, gram)):
        compressed, _ = compress_latent(layer, key_latent_dims(kv_heads, 8, 2), full, mode, gr)
        torch.testing.assert_close(mla_forward(config, compressed, x), reference_partial_rope(src, x, pairs), **TOL)
    # every pair kept: the source layer itself
    all_pairs = select_pairs("high", kv_heads, 8, 4)
    layer = partial_rope(replicate(src), all_pairs, src.geometry.num_heads, 8)
    torch.testing.assert_close(mla_forward(config, layer, x), reference_partial_rope(src, x, None), **TOL)


def _gram(x: torch.Tensor) -> torch.Tensor:
    xa = torch.cat((x.reshape(-1, x.shape[-1]), torch.ones(x[..., 0].numel(), 1)), dim=1).double()  # [N, D+1]
    return xa.T @ xa / xa.shape[0]


def _anisotropic_inputs(D: int, n: int = 4096, seed: int = 0) -> torch.Tensor:
    """Calibration-like inputs: a few strong directions, a non-zero mean (as LLM hidden states have)."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))[0]
    scales = torch.logspace(1, -2, D, dtype=torch.float64)
    x = torch.randn(n, D, generator=g, dtype=torch.float64) * scales @ basis.T
    return (x + 0.5 * basis[:, -1]).float()  # [n, D]


def test_split_shares_the_rank_and_minimises_the_summed_error():
    assert share_rank(torch.tensor([9.0, 5, 1]), torch.tensor([7.0, 6, 0.5]), 4) == (2, 2)
    assert share_rank(torch.tensor([9.0, 8, 7]), torch.tensor([1.0]), 3) == (3, 0)
    assert share_rank(torch.tensor([2.0]), torch.tensor([2.0]), 1) == (1, 0)  # ties go to K
    with pytest.raises(ValueError, match="exceeds"):
        share_rank(torch.ones(2), torch.ones(2), 5)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(10, 16, generator=g) * torch.logspace(0.5, -0.5, 10)[:, None]
    gram = _gram(_anisotropic_inputs(16, 512))
    for gr, rank in itertools.product((None, gram), (3, 6)):
        f = factor_latent(w, None, 4, rank, "split", gr)
        assert f.up.shape == (10, rank) and sum(f.ranks) == rank
        approx = f.up @ f.down

        def err(a):  # summed K and V error in the objective's norm
            wa = w.double() if gr is None else with_bias_column(w, None).double()
            e = wa - a
            return (e * e).sum().item() if gr is None else torch.trace(e @ gr @ e.T).item()

        best = err(approx)
        # any other split of the same total rank, each block at its best rank-r, is no better
        for r_k in range(0, min(rank, 4) + 1):
            if rank - r_k > 6:
                continue
            other = factor_latent(w[:4], None, 4, r_k, "joint", gr), factor_latent(w[4:], None, 0, rank - r_k, "joint", gr)
            a = torch.cat((other[0].up @ other[0].down, other[1].up @ other[1].down))
            assert best <= err(a) + 1e-9


@pytest.mark.parametrize("mode", ["joint", "split"])
def test_activation_aware_svd_beats_weight_svd_on_calibration_data(tiny_factory, mode):
    _, path = tiny_factory("llama", bias=True)
    config, src = _layer0(path)
    x = _anisotropic_inputs(src.geometry.hidden_size)
    gram = _gram(x)
    layer = partial_rope(replicate(src), select_pairs("high", 2, 8, 1), 6, 8)
    k_dims = key_latent_dims(2, 8, 1)
    xb = x.view(8, -1, x.shape[-1])[:, :64]  # [8, 64, D] sequences drawn from the same data
    ref = mla_forward(config, layer, xb)
    for rank in (4, 8, 12):
        errors = {}
        for weighting, gr in (("none", None), ("activation", gram), ("centred", gram)):
            f = factor_latent(layer.kv_a_proj[: k_dims + 16], layer.kv_a_bias[: k_dims + 16], k_dims, rank, mode, gr, center=weighting == "centred")
            w_full = with_bias_column(layer.kv_a_proj[: k_dims + 16], layer.kv_a_bias[: k_dims + 16]).double()
            approx = f.up @ f.down
            if f.down.shape[1] == w_full.shape[1] - 1:  # weight SVD: bias kept exactly beside the latent
                approx = torch.cat((approx, w_full[:, -1:]), dim=1)
            e = w_full - approx
            if f.out_bias is not None and weighting == "centred":
                e[:, -1] -= f.out_bias
            latent_err = torch.trace(e @ gram @ e.T).item()  # E||(W - W_hat)[x; 1]||^2
            compressed, _ = compress_latent(layer, k_dims, rank, mode, gr, center=weighting == "centred")
            out_err = (mla_forward(config, compressed, xb) - ref).pow(2).mean().item()
            errors[weighting] = (latent_err, out_err)
        assert errors["activation"][0] < errors["none"][0]  # what activation-aware minimises
        assert errors["activation"][1] < errors["none"][1]  # and the layer output follows
        assert errors["centred"][0] <= errors["activation"][0] + 1e-9  # the best affine fit


# -- budget and validation ----------------------------------------------------------------------------


SMOL = AttentionGeometry(hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64, num_layers=30)


def test_budget_derives_the_rank():
    assert [mha2mla_budget(384, f, 3, 4) for f in (0.5, 0.25, 0.125)] == [168, 72, 24]  # d_kv 56/24/8 per head
    assert default_rope_pairs(64) == 4 and default_rope_pairs(128) == 8 and default_rope_pairs(8) == 1
    shape = resolve_shape(SMOL, 4, None, 0.25)
    assert (shape.kv_lora_rank, shape.rope_dim, shape.kv_elements, shape.full_latent) == (72, 24, 96, 360)
    with pytest.raises(ValueError, match="already take 24"):
        mha2mla_budget(384, 0.05, 3, 4)
    with pytest.raises(ValueError, match="fraction"):
        mha2mla_budget(384, 0.0, 3, 4)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(rope_pairs=33, kv_lora_rank=8), "rope_pairs must be a whole number of pairs in 0..32"),
        (dict(rope_pairs=-1, kv_lora_rank=8), "rope_pairs"),
        (dict(rope_pairs=4, kv_lora_rank=361), r"kv_lora_rank must be in 1..360"),
        (dict(rope_pairs=4, kv_lora_rank=0), r"kv_lora_rank must be in 1..360"),
        (dict(rope_pairs=4, kv_lora_rank=8, kv_budget=0.5), "either"),
        (dict(rope_pairs=4), "needs the latent size"),
    ],
)
def test_shape_validation(kwargs, message):
    args = dict(rope_pairs=None, kv_lora_rank=None, kv_budget=None) | kwargs
    with pytest.raises(ValueError, match=message):
        resolve_shape(SMOL, args["rope_pairs"], args["kv_lora_rank"], args["kv_budget"])


def test_no_shrink_warns_and_bad_options_fail():
    with pytest.warns(UserWarning, match="does not shrink"):
        resolve_shape(SMOL, 32, 192, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolve_shape(SMOL, 4, 168, None)
    shape = resolve_shape(SMOL, 4, 168, None)
    for field, value, message in (("rope_select", "mid", "rope_select must"), ("svd", "tucker", "svd must"), ("svd_weighting", "x", "svd_weighting must")):
        with pytest.raises(ValueError, match=message):
            MHA2MLASettings(shape, **{field: value})


def test_transmla_options_are_refused(tiny_factory):
    _, path = tiny_factory("llama")
    for opts, message in (
        (dict(rope_dim=8, kv_lora_rank=8), "rope_dim does not apply to method mha2mla"),
        (dict(freqfold="2", kv_lora_rank=8), "freqfold does not apply to method mha2mla"),
        (dict(q_lora_rank=8, kv_lora_rank=8), "q_lora_rank does not apply to method mha2mla"),
    ):
        with pytest.raises(ValueError, match=message):
            convert(str(path), path.parent / "out", ConvertOptions.of(method="mha2mla", **opts), progress=False)


# -- whole models through real files ------------------------------------------------------------------


@pytest.mark.parametrize("family,kw", [("llama", {}), ("llama", {"num_key_value_heads": 6}), ("qwen2", {}), ("mistral", {}), ("mixtral", {})])
def test_every_pair_full_rank_reproduces_the_source(tiny_factory, tmp_path, family, kw):
    model, path = tiny_factory(family, **kw)
    g = model.config.num_key_value_heads
    ids = _ids()
    with torch.no_grad():
        ref = model(ids).logits
    for select, svd in (("uniform", "joint"), ("low", "split")):
        opts = ConvertOptions.of(method="mha2mla", rope_pairs=4, kv_lora_rank=g * 8, rope_select=select, svd=svd,
                             svd_weighting="none")  # weight SVD: no calibration, exact at full rank
        out = tmp_path / f"mla-{select}"
        with pytest.warns(UserWarning, match="does not shrink"):
            result = convert(str(path), out, opts, progress=False)
        assert result.kv_elements_per_token_per_layer == g * 8 + g * 8
        mla = _load(out)
        with torch.no_grad():
            torch.testing.assert_close(mla(ids).logits, ref, **TOL)


@pytest.mark.parametrize("family,bias", [("llama", True), ("qwen2", True), ("mistral", False), ("mixtral", False)])
def test_calibrated_conversion_compresses_and_decodes(tiny_factory, tmp_path, family, bias):
    """2norm + activation-aware split SVD through the real calibration engine and checkpoint files."""
    model, path = tiny_factory(family, bias=bias)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    calib = _ids(seed=3, batch=4, length=32)
    opts = ConvertOptions.of(method="mha2mla", rope_pairs=1, kv_budget=0.25, rope_select="2norm", svd="split", svd_weighting="activation")
    layers = LayerStream(get_method("mha2mla"), path, config, opts, progress=False, calib_ids=calib)
    result = write_mla_checkpoint(path, config, tmp_path / "mla", layers, layers.record)
    meta = layers.record()
    assert result.kv_elements_per_token_per_layer == 8  # 32 * 0.25: R = 4 + 2 heads x 1 pair x 2
    assert len(meta["layers"]) == 2 and all(info["rank_k"] + info["rank_v"] == 4 for info in meta["layers"])
    mla = _load(tmp_path / "mla")
    attn = mla.model.layers[0].self_attn
    assert attn.kv_a_proj.weight.shape == (4 + 4, 48) and attn.config.qk_rope_head_dim == 4
    if bias:  # the source's q/k/v biases travel (none dropped): the query's as is, k/v's through the latent
        recorded = json.loads((tmp_path / "mla" / "config.json").read_text())["mla"]
        assert recorded["q_bias"] and (recorded["kv_a_bias"] or recorded["kv_b_bias"]), recorded
    # the selected pairs are the top 2-norm pairs of the calibration statistics
    stats = []
    for _ in calibrated_layers(path, config, calib, lambda i, s, st: stats.append(st) or replicate(s), pair_norms=True, progress=False):
        pass
    for info, st in zip(meta["layers"], stats):
        assert info["pairs"] == top_pairs(two_norm_scores(st.q_pair_norm, st.k_pair_norm), 1).tolist()
    ids = _ids(seed=5, batch=1, length=10)
    with torch.no_grad():
        full = mla(ids).logits
        assert torch.isfinite(full).all()
        # absorbed decode over the latent cache equals the expanded forward
        out = mla(ids[:, :-1], use_cache=True)
        step = mla(ids[:, -1:], past_key_values=out.past_key_values, use_cache=True).logits
    torch.testing.assert_close(step[:, -1], full[:, -1], **TOL)


def test_method_layer_matches_settings(tiny_factory):
    _, path = tiny_factory("qwen2")
    config, src = _layer0(path)
    shape = resolve_shape(attention_geometry(config), 2, 10, None)
    layer, info = mha2mla_layer(src, MHA2MLASettings(shape, "uniform", "split", "none"))
    assert info["pairs"] == [[0, 2], [0, 2]] and info["rank_k"] + info["rank_v"] == 10
    assert layer.kv_a_proj.shape == (10 + 8, 48) and layer.kv_b_proj.shape == (6 * (4 + 8), 10)
    assert layer.kv_b_bias is not None  # weight SVD keeps the source's k/v biases exactly, after the up-projection
    with pytest.raises(ValueError, match="needs calibration"):
        mha2mla_layer(src, MHA2MLASettings(shape, "2norm"))


def test_convert_layer_at_ranks_is_convert_layer_at_each_rank(tiny_factory):
    """The benchmarks' shortcut (one SVD truncated to several ranks) gives, bit for bit, what
    convert_layer gives at each rank."""
    from dataclasses import fields, replace

    from transmla.convert.calibrate import LayerStats
    from transmla.convert.layers import MLALayer

    _, path = tiny_factory("llama", bias=True)
    config, src = _layer0(path)
    x = _anisotropic_inputs(src.geometry.hidden_size)
    g = src.geometry
    stats = LayerStats(gram=_gram(x), tokens=x.shape[0], q_pair_norm=torch.rand(g.num_heads, g.head_dim // 2),
                       k_pair_norm=torch.rand(g.num_kv_heads, g.head_dim // 2))
    method = get_method("mha2mla")
    for select, svd, weighting in (("2norm", "joint", "activation"), ("high", "split", "none")):
        options = get_method("mha2mla").Options(kv_lora_rank=4, rope_pairs=1, rope_select=select, svd=svd, svd_weighting=weighting)
        plan = method.plan(attention_geometry(config), options)
        ranks = [4, 9, 2]
        for rank, (layer, info) in zip(ranks, method.convert_layer_at_ranks(plan, src, stats, ranks)):
            one, one_info = method.convert_layer(replace(plan, shape=replace(plan.shape, kv_lora_rank=rank)), src, stats)
            assert info == one_info
            for f in fields(MLALayer):
                a, b = getattr(layer, f.name), getattr(one, f.name)
                assert (a is None and b is None) or torch.equal(a, b), f.name


# -- MHA copy -------------------------------------------------------------------------------------------


def test_repeat_kv_heads():
    w = torch.arange(2 * 3 * 2).float().view(2 * 3, 2)  # g=2 heads of d=3
    r = repeat_kv_heads(w, 2, 2)
    assert r.view(4, 3, 2)[1].tolist() == w.view(2, 3, 2)[0].tolist() and r.view(4, 3, 2)[2].tolist() == w.view(2, 3, 2)[1].tolist()


@pytest.mark.parametrize("family,bias", [("llama", True), ("qwen2", False)])
def test_mha_copy_is_the_same_function(tiny_factory, tmp_path, family, bias):
    model, path = tiny_factory(family, bias=bias)
    out = make_mha_copy(path, tmp_path / "mha")
    mha = _load(out)
    assert mha.config.num_key_value_heads == mha.config.num_attention_heads == 6
    ids = _ids()
    with torch.no_grad():
        ref = model(ids).logits
        torch.testing.assert_close(mha(ids).logits, ref, **TOL)
    # and MHA2MLA of the MHA copy, every pair kept at full rank, is the GQA model too
    opts = ConvertOptions.of(method="mha2mla", rope_pairs=4, kv_lora_rank=6 * 8, svd="joint", svd_weighting="none")
    with pytest.warns(UserWarning, match="does not shrink"):
        convert(str(out), tmp_path / "mla", opts, progress=False)
    with torch.no_grad():
        torch.testing.assert_close(_load(tmp_path / "mla")(ids).logits, ref, **TOL)
    with pytest.raises(FileExistsError):
        make_mha_copy(path, tmp_path / "mha")


def test_mha_copy_with_a_fixed_selection_is_the_gqa_conversion(tiny_factory, tmp_path):
    """Repeated rows span the same latent: MHA copy at rank R == GQA at rank R (the benchmark reuses this)."""
    from transformers import AutoConfig

    from transmla.convert.assemble import assemble_model

    model, path = tiny_factory("llama", bias=True)
    mha = make_mha_copy(path, tmp_path / "mha")
    calib = _ids(seed=3, batch=4, length=32)
    ids = _ids(seed=4)
    for svd, weighting in (("joint", "none"), ("split", "activation")):
        logits = []
        for p in (path, mha):
            config = AutoConfig.from_pretrained(p)
            opts = ConvertOptions.of(method="mha2mla", rope_pairs=2, kv_lora_rank=5, rope_select="low", svd=svd, svd_weighting=weighting)
            layers = LayerStream(get_method("mha2mla"), p, config, opts, progress=False, calib_ids=calib)
            with torch.no_grad():
                logits.append(assemble_model(p, config, list(layers), layers.record())(ids).logits)
        torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)
