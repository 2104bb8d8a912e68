"""TransMLA: RoRoPE, FreqFold, BKV-PCA, the layer-by-layer method and its validation.

Exactness ladder: every key dim kept as rope reproduces the source (fp32 ~1e-5); with components
dropped, the layer equals an independent partial-RoPE attention written from the definition; the
joint PCA at full rank equals that partial-RoPE layer. Every family goes through real files.
"""

from __future__ import annotations

import math
import warnings
from functools import partial

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import transmla  # noqa: F401  (registers the MLA models)
from transmla.convert.lowrank import with_bias_column
from transmla.convert.transmla.bkv import bkv_alpha, joint_pca
from transmla.convert.transmla.budget import shared_rope_budget, transmla_budget, validate_transmla_shape
from transmla.convert.assemble import assemble_model
from transmla.convert.calibrate import mla_attention, collect_layer_stats
from transmla.convert.options import CalibrationOptions, ConvertOptions
from transmla.convert.layers import source_layers
from transmla.convert.pipeline import LayerStream, write_mla_checkpoint
from transmla.convert.transmla.fold import auto_fold, fold_candidates
from transmla.convert.transmla.rorope import (
    kept_frequencies,
    logit_error,
    pair_second_moment,
    rorope,
    select_components,
)
from transmla.convert.transmla.method import (
    LayerMoments,
    TransMLAPlan,
    choose_rope,
    convert_layer,
    TransMLAOptions,
    augmented_maps,
    plan_from_options,
    published_plan,
    stage_layers,
)
from transmla.convert.registry import get_method
from transmla.families import attention_geometry
from transmla.eval.stages import stage_perplexities

TOL = dict(atol=1e-5, rtol=1e-5)
FAMILIES = [("llama", {}), ("qwen2", {"bias": True}), ("mistral", {}), ("mixtral", {})]
G, D_HEAD, H = 2, 8, 6  # the tiny models: 2 KV heads, head_dim 8, 6 query heads (conftest.TINY)


def _ids(seed=0, batch=2, length=24, vocab=97):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def _convert_files(path, out, plan, propagate="original"):
    """The production path: read the source from disk, calibrate layer by layer, write, reload."""
    config = AutoConfig.from_pretrained(path)
    options = ConvertOptions.of(method="transmla", propagate=propagate, device="cpu")
    layers = LayerStream(get_method("transmla"), path, config, options, progress=False, calib_ids=_ids(1, 4, 32), plan=plan)
    result = write_mla_checkpoint(path, config, out, layers, layers.record, progress=False)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    return model, result, layers.record()


def _stats(path):
    config = AutoConfig.from_pretrained(path)
    return config, list(source_layers(path, config)), collect_layer_stats(path, config, _ids(1, 4, 32), progress=False)


# -- exactness through real files -----------------------------------------------------------------


@pytest.mark.parametrize("family,kw", FAMILIES, ids=[f for f, _ in FAMILIES])
def test_rorope_every_dim_rope_equals_source(tiny_factory, tmp_path, family, kw):
    """RoRoPE rotates the key pairs across heads, the same rotation on the queries: with every
    component kept as rope and the values as the latent, the logits are the source's."""
    source, path = tiny_factory(family, **kw)
    plan = TransMLAPlan(kv_lora_rank=G * D_HEAD, rope_dim=G * D_HEAD, freqfold=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cache does not shrink here, by design
        model, result, meta = _convert_files(path, tmp_path / "out", plan)
    x = _ids(2)
    torch.testing.assert_close(model(x).logits, source(x).logits, **TOL)
    assert result.kv_elements_per_token_per_layer == 2 * G * D_HEAD
    assert len(meta["layers"]) == 2 and all(info["freqfold"] == 1 for info in meta["layers"])
    # it really is a rotation, not the replicated identity layout
    rope_rows = model.model.layers[0].self_attn.kv_a_proj.weight[G * D_HEAD :]
    assert not torch.allclose(rope_rows.abs().sum(1).sort().values, source.model.layers[0].self_attn.k_proj.weight.abs().sum(1).sort().values)


@pytest.mark.parametrize("family,kw", FAMILIES, ids=[f for f, _ in FAMILIES])
def test_lossy_conversion_loads_and_shrinks(tiny_factory, tmp_path, family, kw):
    """A compressed conversion through files: the loaded model equals the in-memory one and the cache is R + r."""
    source, path = tiny_factory(family, **kw)
    plan = TransMLAPlan(kv_lora_rank=6, rope_dim=4, freqfold="auto", centre=True)
    model, result, meta = _convert_files(path, tmp_path / "out", plan, propagate="converted")
    assert result.kv_elements_per_token_per_layer == 10 and result.mla.qk_nope_head_dim == D_HEAD
    assert {info["freqfold"] for info in meta["layers"]} <= set(fold_candidates(D_HEAD, 2, "uniform"))
    x = _ids(3)
    logits = model(x).logits
    assert torch.isfinite(logits).all()
    assert (logits - source(x).logits).abs().max() > 1e-4  # lossy, as it should be
    # absorbed decode over the latent cache agrees with the full forward
    out = model(x[:, :-1], use_cache=True)
    step = model(x[:, -1:], past_key_values=out.past_key_values, use_cache=True).logits
    torch.testing.assert_close(step[:, -1], logits[:, -1], atol=1e-4, rtol=1e-4)


# -- the partial-RoPE layer against the definition ------------------------------------------------


def reference_partial_rope(src, x, rotation, kept, freqs):
    """Attention where key/query pairs are rotated per fold group by the rotation's bases, the
    kept components rotate with their assigned frequency and the others carry no RoPE. x [1, T, D]."""
    geo = src.geometry
    g, d, n, f = geo.num_kv_heads, geo.head_dim, geo.group_size, rotation.fold
    half, T = d // 2, x.shape[1]
    x = x[0].double()
    lin = lambda w, b: x @ w.double().T + (0 if b is None else b.double())  # noqa: E731
    q = lin(src.wq, src.bq).view(T, geo.num_heads, d)
    k = lin(src.wk, src.bk).view(T, g, d)
    v = lin(src.wv, src.bv).view(T, g, d)
    qc = torch.complex(q[..., :half], q[..., half:])  # [T, H, d/2]
    kc = torch.complex(k[..., :half], k[..., half:])  # [T, g, d/2]
    omega = dict(zip(kept.tolist(), freqs.double().tolist()))
    pos = torch.arange(T, dtype=torch.float64)
    delta = pos[:, None] - pos[None, :]  # [T, T]
    scores = torch.zeros(geo.num_heads, T, T, dtype=torch.float64)
    w = rotation.group_width
    for a in range(rotation.num_groups):
        u = rotation.basis[a].to(torch.complex128)  # [gF rows (j, k), gF components]
        k_grp = kc[:, :, a * f : (a + 1) * f].reshape(T, g * f)  # (j, k) order
        k_rot = k_grp @ u  # [T, gF] components z'_c = sum u[(j,k), c] z_(j,k)
        for h in range(geo.num_heads):
            j = h // n
            q_grp = torch.zeros(T, g * f, dtype=torch.complex128)
            q_grp[:, j * f : (j + 1) * f] = qc[:, h, a * f : (a + 1) * f]  # slot-placed
            q_rot = q_grp @ u
            for c in range(w):
                m = a * w + c
                phase = torch.exp(1j * omega[m] * delta) if m in omega else torch.ones_like(delta)
                scores[h] += (q_rot[:, c, None] * k_rot[None, :, c].conj() * phase).real
    scores = scores / math.sqrt(d)
    scores = scores.masked_fill(delta[None] < 0, float("-inf"))
    p = scores.softmax(-1)  # [H, T, T]
    out = torch.stack([p[h] @ v[:, h // n] for h in range(geo.num_heads)], dim=1)  # [T, H, d]
    o = out.reshape(T, -1) @ src.wo.double().T
    return o + (0 if src.bo is None else src.bo.double())


@pytest.mark.parametrize("fold,rope_dim,selection,family,rotation", [
    (1, 8, "uniform", "llama", "real"), (2, 4, "uniform", "qwen2", "real"), (1, 6, "score", "qwen2", "real"),
    (4, 4, "score", "llama", "real"), (1, 8, "uniform", "llama", "unitary"), (2, 4, "score", "qwen2", "unitary"),
])
def test_partial_rope_layer_matches_definition(tiny_factory, fold, rope_dim, selection, family, rotation):
    _, path = tiny_factory(family, bias=family == "qwen2")
    config, srcs, stats = _stats(path)
    src, gram = srcs[1], stats[1].gram
    plan = TransMLAPlan(kv_lora_rank=2 * G * D_HEAD - rope_dim, rope_dim=rope_dim, freqfold=fold, selection=selection,
                        rotation=rotation)
    choice, _ = choose_rope(src, LayerMoments.of(src, gram), plan)
    assert choice.rotation.unitary == (rotation == "unitary")
    staged = stage_layers(src, gram, plan)
    attn = mla_attention(config, staged["freqfold"], "cpu")
    x = torch.randn(1, 12, config.hidden_size, generator=torch.Generator().manual_seed(4))
    ours = attn(x, position_ids=torch.arange(12)[None])[0][0].double()
    ref = reference_partial_rope(src, x, choice.rotation, choice.kept, choice.inv_freq)
    torch.testing.assert_close(ours, ref, **TOL)


def test_joint_pca_full_rank_equals_partial_rope(tiny_factory):
    """BKV balance + joint PCA at R = 2*g*d - r (uncentred and centred) is the partial-RoPE model."""
    _, path = tiny_factory("qwen2", bias=True)
    config, srcs, stats = _stats(path)
    x = _ids(5)
    for centre, metric in ((False, "activation"), (True, "activation"), (False, "attention"), (True, "output")):
        plan = TransMLAPlan(kv_lora_rank=2 * G * D_HEAD - 4, rope_dim=4, freqfold=2, centre=centre, pca_metric=metric)
        final, partial = [], []
        for src, st in zip(srcs, stats):
            layer, info = convert_layer(src, st.gram, plan)
            staged = stage_layers(src, st.gram, plan)
            final.append(layer)
            partial.append(staged["freqfold"])
            assert info["pca_energy_kept"] == pytest.approx(1.0)
        a = assemble_model(path, config, final)(x).logits
        b = assemble_model(path, config, partial)(x).logits
        torch.testing.assert_close(a, b, **TOL)
    lossy = TransMLAPlan(kv_lora_rank=5, rope_dim=4, freqfold=2)
    c = assemble_model(path, config, [convert_layer(s, st.gram, lossy)[0] for s, st in zip(srcs, stats)])(x).logits
    assert (c - b).abs().max() > 1e-3


def test_attention_metric_lowers_the_error_it_weighs(tiny_factory):
    """At equal rank the attention-weighted PCA has a smaller expected squared score + output
    error (the metric's objective, the key block BKV-scaled) than the plain PCA of the activations."""
    from transmla.convert.transmla.bkv import attention_metric
    from transmla.convert.transmla.rorope import split_rope

    _, path = tiny_factory("llama")
    _, srcs, stats = _stats(path)
    src, gram = srcs[1], stats[1].gram.double()
    plan = TransMLAPlan(kv_lora_rank=6, rope_dim=4, freqfold=2)
    m = LayerMoments.of(src, gram)
    choice, _ = choose_rope(src, m, plan)
    wq, wk, wv = augmented_maps(src)
    part = split_rope(wq, wk, H, choice.rotation, choice.kept, choice.inv_freq)
    metric = attention_metric(part.nope_to_head, m.query, src.wo, H)
    m_k, m_v = metric.key @ metric.key, metric.value @ metric.value

    weighted = joint_pca(part.k_nope, wv, gram, 6, metric=metric)
    plain = joint_pca(part.k_nope, wv, gram, 6)

    def error(pca):  # E (q . e_k)^2 / alpha^2 + E ||W_o e_v||^2 summed over heads
        e_k = part.k_nope.double() - pca.up_k @ pca.down
        e_v = wv.double() - pca.up_v @ pca.down
        return float(torch.trace(m_k @ e_k @ gram @ e_k.T) / weighted.alpha**2 + torch.trace(m_v @ e_v @ gram @ e_v.T))

    assert error(weighted) < 0.95 * error(plain)
    with pytest.raises(ValueError, match="pca_metric"):
        convert_layer(src, gram, TransMLAPlan(kv_lora_rank=6, rope_dim=4, freqfold=2, pca_metric="nope"))


def test_bkv_balances_column_norms(tiny_factory):
    _, path = tiny_factory("llama")
    _, srcs, stats = _stats(path)
    src, gram = srcs[0], stats[0].gram
    k = with_bias_column(src.wk, src.bk, torch.float64) * 7.0  # a key much larger than the value
    v = with_bias_column(src.wv, src.bv, torch.float64)
    alpha = bkv_alpha(k, v, gram)
    col = lambda w: torch.einsum("od,de,oe->o", w, gram, w).sqrt().mean()  # noqa: E731
    assert col(k / alpha) == pytest.approx(float(col(v)), rel=1e-9)
    pca = joint_pca(k, v, gram, rank=5)
    assert pca.alpha == pytest.approx(alpha) and pca.up_k.shape == (G * D_HEAD, 5) and pca.down.shape == (5, 49)


def test_low_rank_query(tiny_factory):
    """--q-lora-rank: exact at full input rank, a smaller rank loads and runs."""
    _, path = tiny_factory("qwen2", bias=True)
    config, srcs, stats = _stats(path)
    x = _ids(6)
    base = TransMLAPlan(kv_lora_rank=12, rope_dim=4, freqfold=2)
    models = {}
    for q in (None, config.hidden_size, 7):
        plan = TransMLAPlan(kv_lora_rank=12, rope_dim=4, freqfold=2, q_lora_rank=q)
        layers = [convert_layer(s, st.gram, plan)[0] for s, st in zip(srcs, stats)]
        models[q] = assemble_model(path, config, layers)(x).logits
        if q is not None:
            assert layers[0].q_a_proj.shape == (q, config.hidden_size) and layers[0].q_bias is not None
    torch.testing.assert_close(models[config.hidden_size], models[None], atol=1e-4, rtol=1e-4)
    assert torch.isfinite(models[7]).all() and base.q_lora_rank is None


# -- RoRoPE / FreqFold pieces ---------------------------------------------------------------------


def test_rorope_basis_and_selection():
    torch.manual_seed(0)
    a = torch.randn(G * D_HEAD, 64, dtype=torch.float64)
    moment = a @ a.T / 64
    pairs = pair_second_moment(moment, G, D_HEAD)
    for fold in (1, 2, 4):
        rot = rorope(pairs, G, D_HEAD, fold)
        t = rot.matrix()
        torch.testing.assert_close(t @ t.T, torch.eye(G * D_HEAD // 2, dtype=torch.float64))
        assert (rot.energy[:, :-1] >= rot.energy[:, 1:]).all()  # descending per group
        torch.testing.assert_close(torch.diagonal(t @ pairs @ t.T), rot.energy.reshape(-1))
        kept = select_components(rot, 4, "uniform")
        assert kept.numel() == 4 and (kept % rot.group_width < 4 // rot.num_groups).all()
    rot = rorope(pairs, G, D_HEAD, 4)  # one group of 4 frequencies x 2 heads, keep 2: w_0 and w_2
    inv = torch.tensor([1.0, 0.5, 0.25, 0.125])
    torch.testing.assert_close(kept_frequencies(rot, torch.tensor([0, 1]), inv), torch.tensor([1.0, 0.25]))
    with pytest.raises(ValueError, match="not a multiple"):
        select_components(rorope(pairs, G, D_HEAD, 1), 3, "uniform")


def test_logit_error_criterion(tiny_factory):
    """Zero when every component stays rope at its own frequency; grows as components lose RoPE;
    'logit' picks the fold with the least error."""
    _, path = tiny_factory("llama")
    _, srcs, stats = _stats(path)
    src, gram = srcs[0], stats[0].gram
    m = LayerMoments.of(src, gram)
    rot = rorope(pair_second_moment(m.key, G, D_HEAD), G, D_HEAD, 1)
    everything = torch.arange(G * D_HEAD // 2)
    exact = logit_error(rot, everything, kept_frequencies(rot, everything, src.inv_freq), src.inv_freq, m.key, m.query)
    assert abs(exact) < 1e-9
    errs = []
    for pairs in (8, 4, 0):
        kept = select_components(rot, pairs, "score", torch.arange(8, 0, -1).double()) if pairs else everything[:0]
        errs.append(logit_error(rot, kept, kept_frequencies(rot, kept, src.inv_freq), src.inv_freq, m.key, m.query))
    assert errs[0] < errs[1] < errs[2]
    choice, tried = choose_rope(src, m, TransMLAPlan(kv_lora_rank=8, rope_dim=4, freqfold="logit", selection="uniform"))
    assert set(tried) == {2, 4} and choice.logit_error == min(tried.values())


def test_stage_perplexities(tiny_factory):
    """--eval-data's stages: source, RoRoPE, FreqFold, BKV-PCA; at full rank the last two coincide."""
    _, path = tiny_factory("llama")
    config, srcs, stats = _stats(path)
    plan = TransMLAPlan(kv_lora_rank=2 * G * D_HEAD - 4, rope_dim=4, freqfold=4)
    staged = {}
    for s, st in zip(srcs, stats):
        for name, layer in stage_layers(s, st.gram, plan).items():
            staged.setdefault(name, []).append(layer)
    ppl = stage_perplexities(path, config, staged, _ids(7, 1, 64).reshape(-1), windows=2, seq_len=32)
    assert list(ppl) == ["source", "rorope", "freqfold", "bkv_pca"] and all(math.isfinite(v) for v in ppl.values())
    assert ppl["bkv_pca"] == pytest.approx(ppl["freqfold"], rel=1e-5)


# -- budget and validation ------------------------------------------------------------------------


def test_budget_shapes():
    """A third of the budget as rope dims (the published SmolLM2 shapes at 25% and 12.5%), at most half a
    head: 160 + 32 at 50% on SmolLM2 (chosen on dev windows), DeepSeek's 512 + 64 on 128-dim heads."""
    assert transmla_budget(384, 0.5, 64, 3) == (160, 32)
    assert transmla_budget(384, 0.25, 64, 3) == (64, 32)
    assert transmla_budget(384, 0.125, 64, 3) == (32, 16)
    assert transmla_budget(2048, 576 / 2048, 128, 8) == (512, 64)
    assert transmla_budget(512, 0.25, 128, 2) == (86, 42)  # Qwen2.5-1.5B at 25%: the third binds


def test_shared_rope_budget_shapes():
    """The exportable shape: r/2 dividing head_dim/2 (one rope grid), up to a whole head within a third of
    the budget, the latent the rest: 128 + 64 at 50% on SmolLM2 (its rope grid is then the source's own
    frequencies), the same shapes as the half-head rule rounded to a grid elsewhere."""
    assert shared_rope_budget(384, 0.5, 64, 3) == (128, 64)
    assert shared_rope_budget(384, 0.25, 64, 3) == (64, 32)
    assert shared_rope_budget(384, 0.125, 64, 3) == (32, 16)
    assert shared_rope_budget(512, 0.5, 128, 2) == (192, 64)  # Qwen2.5-1.5B: the third binds at 42 pairs -> 32
    assert shared_rope_budget(512, 0.25, 128, 2) == (96, 32)
    for source, d, g in ((384, 64, 3), (512, 128, 2), (2048, 128, 8), (96, 16, 3)):
        for fraction in (0.05, 0.125, 0.2, 0.25, 1 / 3, 0.5, 0.75, 0.9):
            R, r = shared_rope_budget(source, fraction, d, g)
            assert (d // 2) % (r // 2) == 0 and 2 <= r <= d and R >= 1
            assert R + r == sum(transmla_budget(source, fraction, d, g))  # the same cache as the native shape


def test_validation_errors_and_warning():
    with pytest.raises(ValueError, match="whole rope pairs"):
        validate_transmla_shape(32, 15, 64, 3)
    with pytest.raises(ValueError, match="does not fit"):
        validate_transmla_shape(32, 194, 64, 3)
    with pytest.raises(ValueError, match="larger than the 320"):
        validate_transmla_shape(321, 64, 64, 3)
    with pytest.raises(ValueError, match="positive"):
        validate_transmla_shape(0, 64, 64, 3)
    for fraction in (0, 1, 1.5, float("nan")):  # one range for every method (convert/budget.py)
        with pytest.raises(ValueError, match="between 0 and 1"):
            transmla_budget(384, fraction, 64, 3)
    with pytest.warns(UserWarning, match="does not shrink"):
        validate_transmla_shape(320, 64, 64, 3)


def test_plan_from_options(tiny_factory):
    _, path = tiny_factory("llama")
    config = AutoConfig.from_pretrained(path)
    geo = attention_geometry(config)
    # The default is the exportable shape: one rope grid (one component per FreqFold group, F = d/r)
    default = plan_from_options(TransMLAOptions(kv_budget=0.5), geo)
    assert TransMLAOptions().shared_rope and (default.selection, default.freqfold) == ("grid", 2)
    with pytest.raises(ValueError, match="shared rope grid.*fixes freqfold.*--per-layer-rope"):
        plan_from_options(TransMLAOptions(kv_lora_rank=8, rope_dim=4, freqfold="1"), geo)
    # per-layer rope (--per-layer-rope) leaves every rope choice to the layer
    opts = partial(TransMLAOptions, shared_rope=False)
    plan = plan_from_options(opts(kv_budget=0.5), geo)
    assert (plan.kv_lora_rank, plan.rope_dim) == (12, 4)  # r: whole pairs within a third of 16
    assert plan.selection == "score"
    with pytest.raises(ValueError, match="either kv_budget"):
        plan_from_options(opts(kv_budget=0.5, kv_lora_rank=4), geo)
    with pytest.raises(ValueError, match="needs kv_lora_rank"):
        plan_from_options(opts(kv_lora_rank=4), geo)
    with pytest.raises(ValueError, match="an integer, 'auto' or 'logit'"):
        plan_from_options(opts(kv_lora_rank=8, rope_dim=4, freqfold="x"), geo)
    with pytest.raises(ValueError, match="must divide"):
        plan_from_options(opts(kv_lora_rank=8, rope_dim=4, freqfold="3"), geo)
    # score selection (the default) places any number of rope pairs in any fold
    assert plan_from_options(opts(kv_lora_rank=8, rope_dim=4, freqfold="1"), geo).freqfold == 1
    assert plan_from_options(opts(kv_lora_rank=8, rope_dim=4, freqfold="logit"), geo).freqfold == "logit"
    with pytest.raises(ValueError, match="q_lora_rank"):
        plan_from_options(opts(kv_lora_rank=8, rope_dim=4, q_lora_rank=0), geo)
    assert plan_from_options(opts(kv_lora_rank=8, rope_dim=4, freqfold="Auto"), geo).freqfold == "auto"
    assert published_plan(8, 4, 2).selection == "uniform" and published_plan(8, 4, 2).pca_metric == "activation"


def test_calibration_size_defaults_per_method():
    from transmla.convert.mha2mla.method import DEFAULT_CALIBRATION as MHA2MLA_CALIB
    from transmla.convert.transmla.method import DEFAULT_CALIBRATION as TRANSMLA_CALIB

    assert CalibrationOptions().size(TRANSMLA_CALIB) == TRANSMLA_CALIB == (2048, 16)
    assert CalibrationOptions().size(MHA2MLA_CALIB) == MHA2MLA_CALIB == (2048, 16)
    assert CalibrationOptions(calib_samples=16).size(TRANSMLA_CALIB) == (16, 16)
    assert CalibrationOptions(calib_seq_len=32).size(MHA2MLA_CALIB) == (2048, 32)


def test_auto_fold_is_head_dim_over_rope_dim():
    """--freqfold auto: as many fold groups (d/2F) as kept rope pairs (r/2), F a power of two."""
    assert [auto_fold(64, r) for r in (128, 64, 48, 32, 24, 16, 8, 2)] == [1, 1, 1, 2, 2, 4, 8, 32]
    for r in (2, 4, 8, 16, 32, 64):
        assert (64 // 2) // auto_fold(64, r) == r // 2


# -- the unitary rotation (RoRoPE with a complex basis) -------------------------------------------


def test_unitary_rotation_is_unitary_and_keeps_more_energy():
    """The complex PCA's leading component per group holds at least the real PCA's key energy; its
    basis is unitary and its energies are the components' E|z'_c|^2."""
    torch.manual_seed(0)
    a = torch.randn(G * D_HEAD, 64, dtype=torch.float64)
    # heads whose pairs are 90 degrees out of phase with head 0's: all the real PCA cannot pool
    a[D_HEAD : D_HEAD + D_HEAD // 2] = -a[D_HEAD // 2 : D_HEAD]
    a[D_HEAD + D_HEAD // 2 :] = a[: D_HEAD // 2]
    moment = a @ a.T / 64
    real = rorope(pair_second_moment(moment, G, D_HEAD), G, D_HEAD, 1)
    herm = pair_second_moment(moment, G, D_HEAD, hermitian=True)
    torch.testing.assert_close(herm.real, pair_second_moment(moment, G, D_HEAD))
    uni = rorope(herm, G, D_HEAD, 1)
    t = uni.matrix()
    assert uni.unitary and not real.unitary
    torch.testing.assert_close(t @ t.mH, torch.eye(G * D_HEAD // 2, dtype=torch.complex128))
    torch.testing.assert_close(torch.diagonal(t @ herm.conj() @ t.mH).real, uni.energy.reshape(-1))
    assert (uni.energy[:, 0] >= real.energy[:, 0] - 1e-9).all()
    # the phase-shifted heads: one complex component holds every group's energy, the real one half
    torch.testing.assert_close(uni.energy[:, 0], uni.energy.sum(1))
    assert (real.energy[:, 0] < 0.75 * real.energy.sum(1)).all()


def test_unitary_rorope_every_dim_and_logit_error(tiny_factory, tmp_path):
    """Every component kept at F = 1: the unitary rotation is exact (logits and the logit criterion's
    zero); with fewer rope pairs its expected logit error is finite and the conversion is lossy."""
    source, path = tiny_factory("llama")
    plan = TransMLAPlan(kv_lora_rank=G * D_HEAD, rope_dim=G * D_HEAD, freqfold=1, rotation="unitary")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _, _ = _convert_files(path, tmp_path / "out", plan)
    x = _ids(2)
    torch.testing.assert_close(model(x).logits, source(x).logits, **TOL)
    _, srcs, stats = _stats(path)
    m = LayerMoments.of(srcs[0], stats[0].gram)
    rot = rorope(pair_second_moment(m.key, G, D_HEAD, hermitian=True), G, D_HEAD, 1)
    everything = torch.arange(G * D_HEAD // 2)
    inv = srcs[0].inv_freq
    assert abs(logit_error(rot, everything, kept_frequencies(rot, everything, inv), inv, m.key, m.query)) < 1e-9
    kept = everything[::2]
    assert logit_error(rot, kept, kept_frequencies(rot, kept, inv), inv, m.key, m.query) > 1e-6
    with pytest.raises(ValueError, match="rotation"):
        choose_rope(srcs[0], m, TransMLAPlan(kv_lora_rank=8, rope_dim=4, rotation="complex"))


def test_rotation_auto_is_unitary_where_chosen():
    """--rotation auto: unitary with several KV heads at 25% of the cache and below; real at 50% and with one KV head."""
    from transmla.convert.transmla.method import TransMLAOptions, plan_from_options
    from transmla.families import AttentionGeometry

    smollm2 = AttentionGeometry(576, 9, 3, 64, 30)
    gemma3 = AttentionGeometry(640, 4, 1, 256, 18)
    rotation = lambda geo, **kw: plan_from_options(TransMLAOptions(**kw), geo).rotation  # noqa: E731
    assert [rotation(smollm2, kv_budget=b) for b in (0.5, 0.25, 0.125)] == ["real", "unitary", "unitary"]
    assert rotation(gemma3, kv_budget=0.25) == "real" and rotation(gemma3, kv_budget=0.25, rotation="unitary") == "unitary"
    assert rotation(smollm2, kv_budget=0.25, rotation="real") == "real" and rotation(smollm2, kv_budget=0.5, rotation="Unitary") == "unitary"
