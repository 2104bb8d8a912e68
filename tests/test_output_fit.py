"""The output-aware fit (transmla/convert/output_fit.py): each converted layer's projections fitted to
the source attention's output, streamed layer by layer."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from transmla.convert import output_fit
from transmla.convert.calibrate import mla_attention
from transmla.convert.layers import source_layers
from transmla.convert.qk_norm import attach_pre_maps, linear_source
from transmla.convert.options import ConvertOptions
from transmla.convert.output_fit import FitSettings, fit_layer, output_error, refit_o_proj_errors
from transmla.convert.pipeline import LayerStream, write_mla_checkpoint
from transmla.convert.registry import get_method
from transmla.convert.replicate import replicate
from transmla.convert.transmla.method import DEFAULT_FIT_STEPS, TransMLAPlan
from transmla.dtypes import fast_bf16_matmul

PLAN = TransMLAPlan(kv_lora_rank=4, rope_dim=4, freqfold="auto")  # tiny models: 2 KV heads of 8 -> 8 of 32
# 2048 fit tokens: the tiny layers have ~6K parameters, so fewer tokens overfit (256 did)
FIT_IDS = torch.randint(0, 97, (64, 32), generator=torch.Generator().manual_seed(2))


def _ids(seed, batch, length, vocab=97):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def _source_io(model, layer: int, ids: torch.Tensor):
    """The attention input x (after the input norm) and the source attention's output z of one layer."""
    seen = {}
    attn = model.model.layers[layer].self_attn
    hook = attn.register_forward_hook(lambda m, args, kwargs, out: seen.update(x=kwargs["hidden_states"], z=out[0]),
                                      with_kwargs=True)
    with torch.no_grad():
        model(ids)
    hook.remove()
    return seen["x"], seen["z"]


def _stream(path, fit: FitSettings | None, calib=_ids(1, 8, 32), fit_ids=None, method="transmla", plan=PLAN):
    config = AutoConfig.from_pretrained(path)
    options = ConvertOptions.of(method=method, device="cpu", fit_steps=0 if fit is None else None)
    return config, LayerStream(get_method(method), path, config, options, progress=False, calib_ids=calib,
                               plan=plan, fit_ids=fit_ids, fit=fit)


def _relative_error(config, layer, x, z) -> float:
    attn = mla_attention(config, layer, "cpu")
    with torch.no_grad():
        out = attn(x, position_ids=torch.arange(x.shape[1])[None])[0]
    return float((out - z).pow(2).sum() / z.pow(2).sum())


@pytest.mark.parametrize("family,bias,bf16", [("llama", False, False), ("qwen2", True, False), ("llama", True, False),
                                              ("llama", False, True)])
def test_fit_lowers_the_output_error_on_held_out_tokens(tiny_factory, family, bias, bf16):
    """Every layer's attention output moves towards the source's, on tokens the fit never saw,
    measured by an independent forward of the source model (not the fit's own numbers)."""
    source, path = tiny_factory(family, bias=bias)
    if bias:  # conftest's N(0, 0.5) biases dominate these tiny layers' outputs (errors ~1e-3 before any
        with torch.no_grad():  # fit): smaller ones leave room to measure
            for name, p in source.named_parameters():
                if name.endswith("bias"):
                    p.mul_(0.05)
        source.save_pretrained(path)
    config, plain = _stream(path, None)
    _, fitted = _stream(path, FitSettings(steps=60, bf16=bf16), fit_ids=FIT_IDS)
    plain_layers, fitted_layers = list(plain), list(fitted)
    held_out = _ids(7, 4, 32)
    for i, (a, b) in enumerate(zip(plain_layers, fitted_layers)):
        x, z = _source_io(source, i, held_out)
        before, after = _relative_error(config, a, x, z), _relative_error(config, b, x, z)
        assert after < 0.9 * before, (i, before, after)
        assert {k: v.shape for k, v in b.state_dict("").items()} == {k: v.shape for k, v in a.state_dict("").items()}
        assert fitted.infos[i]["output_error"][1] < fitted.infos[i]["output_error"][0]
    record = fitted.record()
    assert record["calibration"]["fit"] == {"steps": 60, "lr": 1e-3, "closed_form": True, "bf16": bf16,
                                              "bf16_passes": False, "sequences": [64, 32], "repeated_spans": 0}


def _first_layer_io(tiny_factory, ids, family: str = "llama", bias: bool = False):
    """A tiny model's config (llama by default), its first layer as the method converts it, and that layer's
    attention input x and source output z on `ids`."""
    source, path = tiny_factory(family, bias=bias)
    _, stream = _stream(path, None)
    layer = next(iter(stream))
    x, z = _source_io(source, 0, ids)
    return AutoConfig.from_pretrained(path), layer, x, z


@pytest.mark.parametrize("family,bias", [("llama", False), ("qwen2", True)])
def test_closed_form_o_proj_minimises_the_ridge_objective(tiny_factory, family, bias):
    """The closed form, accumulated over batches of 5 sequences, is the stationary point of
    ||Y W^T - Z||^2 + lam ||W - W0||^2 (Y from a separate forward, gradient by autograd), and it
    predicts Z better than the converted o_proj; the error it returns (from its sums) is output_error's."""
    config, layer, x, z = _first_layer_io(tiny_factory, _ids(3, 16, 24), family, bias)
    attn = mla_attention(config, layer, "cpu")
    pos = torch.arange(x.shape[1])[None]
    seen = []
    hook = attn.o_proj.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    with torch.no_grad():
        attn(x, position_ids=pos)
    hook.remove()
    y = seen[0].reshape(-1, attn.o_proj.in_features).double()  # [n, H*d_v]
    target = z.reshape(-1, z.shape[-1]).double()  # [n, D]
    w0 = attn.o_proj.weight.double().clone()
    lam = output_fit.RIDGE * (y * y).sum(0).mean()
    unfitted = output_error(attn, x, z, pos, batch=5)
    before, err = refit_o_proj_errors(attn, x, z, pos, batch=5)
    assert before == pytest.approx(unfitted, rel=1e-6)  # the error before, from the closed form's sums
    assert err == pytest.approx(output_error(attn, x, z, pos, batch=5), rel=1e-6)
    w = attn.o_proj.weight.double().clone().requires_grad_(True)
    objective = (y @ w.T - target).pow(2).sum() + lam * (w - w0).pow(2).sum()
    (grad,) = torch.autograd.grad(objective, w)
    assert grad.abs().max() < 1e-4 * (y.T @ target).abs().max()
    assert (y @ w.detach().T - target).pow(2).sum() < 0.9 * (y @ w0.T - target).pow(2).sum()


def test_an_exact_layer_stays_exact(tiny_factory):
    """A layer that already reproduces the source (the replicated lossless layout) is kept as it is:
    Adam's steps could only perturb it."""
    source, path = tiny_factory("qwen2", bias=True)
    config = AutoConfig.from_pretrained(path)
    src = next(iter(source_layers(path, config)))
    exact = replicate(src)
    x, z = _source_io(source, 0, _ids(4, 8, 16))
    fitted, info = fit_layer(config, exact, x.clone(), z.clone(), FitSettings(steps=20))
    assert info["output_error"][0] < 1e-10
    for name, tensor in exact.state_dict("").items():
        assert torch.equal(fitted.state_dict("")[name], tensor), name


def test_a_diverging_adam_falls_back_to_the_closed_form_o_proj(tiny_factory):
    """Adam with a learning rate far too large for the weights (as 3e-3 was for most layers of
    Qwen2.5-Coder-1.5B) leaves a layer worse: the o_proj-only refit is kept, not the method's layer."""
    config, layer, x, z = _first_layer_io(tiny_factory, _ids(4, 8, 16))
    closed, info_closed = fit_layer(config, layer, x.clone(), z.clone(), FitSettings(steps=0))
    assert info_closed["output_error"][1] < info_closed["output_error"][0]
    diverged, info = fit_layer(config, layer, x.clone(), z.clone(), FitSettings(steps=20, lr=10.0))
    assert info["output_error"] == info_closed["output_error"]
    for name, tensor in closed.state_dict("").items():
        assert torch.equal(diverged.state_dict("")[name], tensor), name


def test_fitted_conversion_through_files_is_closer_to_the_source(tiny_factory, tmp_path):
    """The production path: convert with the fit, write, reload with from_pretrained; the logits on
    held-out tokens are closer to the source's than without the fit, and latent-cache decode agrees."""
    source, path = tiny_factory("llama")
    errors = {}
    for name, fit in (("plain", None), ("fit", FitSettings(steps=60))):
        config, stream = _stream(path, fit, fit_ids=FIT_IDS)
        write_mla_checkpoint(path, config, tmp_path / name, stream, stream.record, progress=False)
        model = AutoModelForCausalLM.from_pretrained(tmp_path / name, dtype=torch.float32).eval()
        x = _ids(9, 3, 24)
        with torch.no_grad():
            logits = model(x).logits
            errors[name] = float((logits - source(x).logits).pow(2).mean())
            out = model(x[:, :-1], use_cache=True)
            step = model(x[:, -1:], past_key_values=out.past_key_values, use_cache=True).logits
        torch.testing.assert_close(step[:, -1], logits[:, -1], atol=1e-4, rtol=1e-4)
    assert errors["fit"] < errors["plain"]
    meta = json.loads((tmp_path / "fit" / "config.json").read_text())["mla"]["method"]
    assert meta["calibration"]["fit"]["steps"] == 60 and len(meta["layers"][0]["output_error"]) == 2


def test_fit_steps_defaults_and_errors(tiny_factory, cli, tmp_path):
    _, path = tiny_factory("llama")
    config = AutoConfig.from_pretrained(path)
    transmla = LayerStream(get_method("transmla"), path, config, ConvertOptions.of(method="transmla", device="cpu"),
                           progress=False, calib_ids=_ids(1, 4, 16), plan=PLAN)
    # Adam under bf16 autocast exactly where the device multiplies bf16 natively, and (PLAN compresses) the other
    # passes too; PLAN keeps 25%: relative rates
    fast = fast_bf16_matmul("cpu")
    assert transmla.fit == FitSettings(steps=DEFAULT_FIT_STEPS, bf16=fast, bf16_passes=fast, **output_fit.RELATIVE_FIT)
    assert DEFAULT_FIT_STEPS > 0
    mha2mla = ConvertOptions.of(method="mha2mla", kv_budget=0.5, device="cpu")
    assert LayerStream(get_method("mha2mla"), path, config, mha2mla, progress=False, calib_ids=_ids(1, 4, 16)).fit is None
    code, _, err = cli("convert", path, tmp_path / "a", "--method", "transmla", "--kv-budget", "0.5", "--fit-steps", "-1")
    assert code != 0 and "--fit-steps must be 0 (off) or positive, got -1" in err and len(err.strip().splitlines()) == 1
    code, _, err = cli("convert", path, tmp_path / "b", "--method", "lossless", "--fit-steps", "5")
    assert code != 0 and "--fit-steps needs a calibrated method" in err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_diverging_adam_restarts_at_a_smaller_rate(tiny_factory):
    """Thirty times the default rate makes this layer's loss rise: Adam restarts at a third of it, and the
    fitted layer is kept (far below the closed form's error). Ten times the rate backs off too, but not when
    judged diverged only at 1.5x its start loss (FitSettings.diverged); a hundred times backs off either way.
    At the default rate nothing backs off."""
    config, layer, x, z = _first_layer_io(tiny_factory, _ids(4, 8, 16))
    _, closed = fit_layer(config, layer, x.clone(), z.clone(), FitSettings(steps=0))
    _, default = fit_layer(config, layer, x.clone(), z.clone(), FitSettings(steps=60))
    _, fast = fit_layer(config, layer, x.clone(), z.clone(), FitSettings(steps=60, lr=0.03))
    assert default["fit_lr"] == 1e-3
    assert fast["fit_lr"] == pytest.approx(0.01)
    assert fast["output_error"][1] < 0.5 * closed["output_error"][1]
    _, lenient = fit_layer(config, layer, x.clone(), z.clone(), FitSettings(steps=60, lr=0.1, diverged=1.5))
    assert lenient["fit_lr"] == pytest.approx(0.1 / 3)
    _, strict = fit_layer(config, layer, x.clone(), z.clone(), FitSettings(steps=60, lr=0.01))
    _, kept = fit_layer(config, layer, x.clone(), z.clone(), FitSettings(steps=60, lr=0.01, diverged=1.5))
    assert strict["fit_lr"] == pytest.approx(0.01 / 3) and kept["fit_lr"] == 0.01


@pytest.mark.parametrize("family,window", [("llama", None), ("mistral", 6)])
def test_outputs_at_sampled_queries_equal_the_full_forward(tiny_factory, family, window):
    """MLAAttention.outputs_at (the fit's loss on a sample of query positions) is the expanded forward's
    output at those positions, sliding window included; fp32, 1e-5."""
    kw = {"sliding_window": window} if window else {}
    source, path = tiny_factory(family, **kw)
    config = AutoConfig.from_pretrained(path)
    _, stream = _stream(path, None)
    layer = next(iter(stream))
    x, _ = _source_io(source, 0, _ids(5, 3, 20))
    attn = mla_attention(config, layer, "cpu")
    assert (config.sliding_window if window else None) == attn.config.window(0) or not window
    at = torch.tensor([0, 3, 7, 8, 15, 19])
    with torch.no_grad():
        full = attn(x, position_ids=torch.arange(x.shape[1])[None])[0]  # [B, T, D]
        sampled = attn.outputs_at(x, at)  # [B, m, D]
    torch.testing.assert_close(sampled, full[:, at], atol=1e-5 * float(full.abs().max()), rtol=1e-5)


@pytest.mark.parametrize("family,bias,window", [("llama", True, None), ("mistral", False, 6), ("qwen3", False, None)])
def test_outputs_at_gradients_equal_the_full_forward(tiny_factory, family, bias, window):
    """outputs_at computes its attention in the absorbed form (mla.attention.attend_rows_differentiable): the fit's Adam
    steps see the expanded forward's gradients, biases, sliding window and QK-norm pre-maps included, and
    under a far mask too (keys_seen); fp32, 1e-5 of the largest gradient."""
    kw = {"sliding_window": window} if window else {}
    source, path = tiny_factory(family, bias=bias, **kw)
    config = AutoConfig.from_pretrained(path)
    _, stream = _stream(path, None)
    layer = next(iter(stream))
    x, _ = _source_io(source, 0, _ids(5, 3, 20))
    attn = mla_attention(config, layer, "cpu")
    for p in attn.parameters():
        p.requires_grad_(True)
    at = torch.tensor([0, 3, 7, 8, 15, 19])
    seen = output_fit.far_mask(x.shape[1], 4, window or 0)[at]  # [m, T], within the window as the forward keeps it
    weight = torch.randn(x.shape[0], at.shape[0], x.shape[2], generator=torch.Generator().manual_seed(3))
    full_mask = torch.zeros(1, 1, x.shape[1], x.shape[1], dtype=torch.bool)
    full_mask[0, 0, at] = seen
    for keys_seen, mask in ((None, None), (seen, full_mask)):
        full = attn(x, position_ids=torch.arange(x.shape[1])[None], attention_mask=mask)[0][:, at]
        want = torch.autograd.grad((full * weight).sum(), list(attn.parameters()))
        got = torch.autograd.grad((attn.outputs_at(x, at, keys_seen) * weight).sum(), list(attn.parameters()))
        for name, g, w in zip([n for n, _ in attn.named_parameters()], got, want):
            scale = float(max(a.abs().max() for a in want))
            torch.testing.assert_close(g, w, atol=1e-5 * scale, rtol=1e-5, msg=lambda m: f"{name}: {m}")


def test_closed_form_on_sampled_queries_minimises_their_ridge_objective(tiny_factory):
    """With closed-form query positions, the o_proj refit is the ridge optimum over those positions' tokens
    only, and the error it returns is output_error's at the same positions."""
    config, layer, x, z = _first_layer_io(tiny_factory, _ids(3, 16, 24))
    attn = mla_attention(config, layer, "cpu")
    pos = torch.arange(x.shape[1])[None]
    at = torch.tensor([1, 2, 5, 11, 17, 23])
    seen = []
    hook = attn.o_proj.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    with torch.no_grad():
        attn.outputs_at(x, at)
    hook.remove()
    y = seen[0].reshape(-1, attn.o_proj.in_features).double()  # [n, H*d_v]
    target = z[:, at].reshape(-1, z.shape[-1]).double()  # [n, D]
    w0 = attn.o_proj.weight.double().clone()
    lam = output_fit.RIDGE * (y * y).sum(0).mean()
    before, err = refit_o_proj_errors(attn, x, z, pos, 5, at)
    assert before == pytest.approx(float((y @ w0.T - target).pow(2).sum() / target.pow(2).sum()), rel=1e-6)
    assert err == pytest.approx(output_error(attn, x, z, pos, 5, at), rel=1e-6)
    w = attn.o_proj.weight.double().clone().requires_grad_(True)
    (grad,) = torch.autograd.grad((y @ w.T - target).pow(2).sum() + lam * (w - w0).pow(2).sum(), w)
    assert grad.abs().max() < 1e-4 * (y.T @ target).abs().max()


def test_a_fit_on_sampled_queries_lowers_the_error_on_every_position(tiny_factory):
    """Adam's loss and the closed forms on a sample of the query positions still fit the whole
    sequence: the output error over every position of held-out sequences falls below the unfitted one."""
    source, path = tiny_factory("llama")
    config, plain = _stream(path, None)
    _, fitted = _stream(path, FitSettings(steps=60, queries=8, closed_form_queries=16), fit_ids=FIT_IDS)
    held_out = _ids(7, 4, 32)
    for i, (a, b) in enumerate(zip(list(plain), list(fitted))):
        x, z = _source_io(source, i, held_out)
        assert _relative_error(config, b, x, z) < 0.9 * _relative_error(config, a, x, z), i


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_the_fit_reads_the_source_attention_io_of_its_layer(tiny_factory, family):
    """With original propagation the fit's x and z are captured while the fit sequences pass through the
    source layer: they equal the source model's own attention input and output at that layer, exactly."""
    from transmla.convert.calibrate import calibrated_layers

    source, path = tiny_factory(family)
    config = AutoConfig.from_pretrained(path)
    fit_ids = _ids(6, 3, 16)
    got = {}

    def record(i, layer, x, z, attend):
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()[None, None]
        got[i] = (x, z, attend(x, causal))  # under a causal mask given as a tensor: z again
        return layer

    for _ in calibrated_layers(path, config, _ids(1, 4, 16), lambda i, src, st: replicate(src),
                               fit_ids=fit_ids, fit_layer=record, progress=False):
        pass
    assert sorted(got) == list(range(config.num_hidden_layers))
    for i, (x, z, attended) in got.items():
        want_x, want_z = _source_io(source, i, fit_ids)
        torch.testing.assert_close(x, want_x, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(z, want_z, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(attended, want_z, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_corrected_propagation_fits_the_converted_input_to_the_source_output(tiny_factory, family):
    """propagate="corrected": the fit of layer i reads x from the model whose earlier layers are the ones
    the fit returned (here layer 0's o_proj moved by a random delta) and z from the source model, exactly;
    the statistics stay the source model's (the same as with original propagation)."""
    from dataclasses import replace as replace_layer

    from transmla.convert.calibrate import calibrated_layers

    source, path = tiny_factory(family)
    config = AutoConfig.from_pretrained(path)
    fit_ids, calib = _ids(6, 3, 16), _ids(1, 4, 16)
    delta = 0.5 * torch.randn(source.model.layers[0].self_attn.o_proj.weight.shape, generator=torch.Generator().manual_seed(3))
    got, stats = {}, {"original": [], "corrected": []}

    def record(i, layer, x, z, attend):
        got[i] = (x, z)
        return replace_layer(layer, o_proj=layer.o_proj + delta) if i == 0 else layer

    def exact(mode):  # the lossless layer, as LayerStream makes it (the key norm of a QK-norm source attached)
        return lambda i, src, st: stats[mode].append(st.gram) or attach_pre_maps(replicate(linear_source(src)), src)

    for mode in ("original", "corrected"):
        for _ in calibrated_layers(path, config, calib, exact(mode), fit_ids=fit_ids, fit_layer=record, propagate=mode,
                                   progress=False):
            pass
    for a, b in zip(stats["original"], stats["corrected"]):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    moved = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        moved.model.layers[0].self_attn.o_proj.weight.add_(delta)
    for i, (x, z) in got.items():  # the corrected run's, recorded last
        torch.testing.assert_close(x, _source_io(moved, i, fit_ids)[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(z, _source_io(source, i, fit_ids)[1], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got[1][0], _source_io(source, 1, fit_ids)[0], atol=1e-3)  # the input did change


def test_fit_sequences_repeat_two_spans():
    """The CLI's fit sequences: calibration_ids' sequences with REPEATED_SPANS spans of each repeated later
    (two: chosen on dev keys at 25% and at 50%), on the built-in model."""
    from transmla.checkpoint.resolve import resolve_model_dir
    from transmla.convert.pipeline import REPEATED_SPANS, calibration_ids, fit_sequences
    from transmla.data.calib import with_repeated_span

    assert REPEATED_SPANS == 2
    src = resolve_model_dir("smollm2-135m")
    got = fit_sequences(src, "wiki", 7)
    plain = calibration_ids(src, "wiki", *got.shape, 7)
    assert torch.equal(got, with_repeated_span(plain, 7, spans=2))
    assert not torch.equal(got, with_repeated_span(plain, 7)) and not torch.equal(got, plain)
    assert torch.equal(fit_sequences(src, "wiki", 7, spans=1), with_repeated_span(plain, 7))


def test_fit_samples_sets_the_fit_sequence_count(tmp_path, cli, monkeypatch):
    """--fit-samples N: the fit runs on N sequences of the calibration text (the default's 64, or 128 for a source
    wider than 1024, halve until they fit a short text); a count below 1 is refused in one line, with nothing
    written."""
    from conftest import make_tiny_model, save_word_tokenizer

    src = tmp_path / "src"
    make_tiny_model("llama", src, num_hidden_layers=1)
    save_word_tokenizer(src)
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"w{(i * 7) % 96}" for i in range(20000)))
    config = AutoConfig.from_pretrained(src)

    def fit_ids(budget=0.5, **kw):
        options = ConvertOptions.of(method="transmla", kv_budget=budget, calib=str(text), calib_samples=8,
                                    calib_seq_len=16, device="cpu", **kw)
        return LayerStream(get_method("transmla"), src, config, options, progress=False).fit_ids

    default, three = fit_ids(), fit_ids(fit_samples=3)
    assert default.shape == (16, 1024)  # 64 halved to what 20,000 tokens hold
    assert three.shape == (3, 1024)
    # the default count by the source's width and the budget: 128 above a hidden size of 1024 at 25% or less, else 64
    # (as LayerStream asks for it)
    assert [output_fit.default_fit_samples(d, 128, 512) for d in (576, 1024, 1025, 1536)] == [64, 64, 128, 128]
    assert [output_fit.default_fit_samples(1536, c, 512) for c in (64, 128, 129, 256, None)] == [128, 128, 64, 64, 64]
    import transmla.convert.pipeline as pipeline

    asked = []
    real = pipeline.fit_sequences
    monkeypatch.setattr(pipeline, "fit_sequences", lambda *a: asked.append(a[4]) or real(*a))
    fit_ids(budget=0.25)
    monkeypatch.setattr(output_fit, "WIDE_FIT_HIDDEN", config.hidden_size - 1)
    fit_ids(budget=0.25)
    fit_ids(budget=0.5)
    fit_ids(budget=0.25, fit_samples=3)
    assert asked == [64, 128, 64, 3]
    code, _, err = cli("convert", src, tmp_path / "out", "--method", "transmla", "--calib", text, "--fit-samples", "0")  # refused before any work
    assert code != 0 and "--fit-samples must be positive, got 0" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_far_mask_sees_only_keys_far_back():
    """Query i sees keys 1 .. i - far (the sink, key 0, never), within a window when there is one; a row
    without such a key sees itself only."""
    m = output_fit.far_mask(8, 3)
    for i in range(8):
        want = {i} if i < 4 else set(range(1, i - 2))
        assert set(torch.nonzero(m[i]).flatten().tolist()) == want, i
    w = output_fit.far_mask(10, 2, window=4)
    assert set(torch.nonzero(w[9]).flatten().tolist()) == {6, 7}


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_far_targets_of_an_exact_layer_equal_its_far_outputs(tiny_factory, family):
    """The source attention under far_mask (through calibrated_layers' `attend`) and an exact MLA layer's
    outputs_at under the same keys agree (fp32, 1e-5): the far loss of an exact layer is zero, so the far
    target is the same attention read from far back on both sides. QK-norm (gemma3) included."""
    _, path = tiny_factory(family)
    config = AutoConfig.from_pretrained(path)
    fit_ids, far = _ids(4, 3, 24), 5
    pairs = {}

    def record(i, layer, x, z, attend):
        attn = mla_attention(config, layer, "cpu", i)
        at = torch.arange(far + 1, x.shape[1])
        window = attn.config.window(attn.layer_idx)  # the one layer's (source layer i's)
        seen = output_fit.far_mask(x.shape[1], far, window)[far + 1 :]
        with torch.no_grad():
            pairs[i] = (output_fit.far_targets(attend, x, far, window, 2), attn.outputs_at(x, at, seen))
        return layer

    _fit_pass(path, config, record, fit_ids=fit_ids)
    assert sorted(pairs) == list(range(config.num_hidden_layers))
    for i, (target, out) in pairs.items():
        assert target.shape == out.shape == (3, 24 - far - 1, config.hidden_size)
        torch.testing.assert_close(out, target, atol=1e-5 * float(target.abs().max()), rtol=1e-5)


@pytest.mark.parametrize("family", ["gemma3_text", "mistral"])
def test_far_fit_runs_on_a_sliding_layer_past_the_first(tiny_factory, family):
    """The far term on a later layer with a sliding window (Gemma 3 270M's layers 15-17 at the CLI's 50%): the
    far target is read under that layer's window (the standalone fit attention holds it as its layer 0; reading
    window(index) there failed with an IndexError past the first layer), equal to the exact layer's own far
    outputs under the window, and the fit runs."""
    window, far = 12, 5
    _, path = tiny_factory(family, sliding_window=window,
                           **({"layer_types": ["sliding_attention"] * 2} if family == "gemma3_text" else {}))
    config = AutoConfig.from_pretrained(path)
    seen_windows = {}

    def record(i, layer, x, z, attend):
        attn = mla_attention(config, layer, "cpu", i)
        seen_windows[i] = attn.config.window(attn.layer_idx)
        at = torch.arange(far + 1, x.shape[1])
        with torch.no_grad():
            target = output_fit.far_targets(attend, x, far, seen_windows[i], 2)
            out = attn.outputs_at(x, at, output_fit.far_mask(x.shape[1], far, seen_windows[i])[far + 1 :])
        torch.testing.assert_close(out, target, atol=1e-5 * float(target.abs().max()), rtol=1e-5)
        fitted, info = fit_layer(config, layer, x.clone(), z.clone(), FitSettings(steps=2, far=far, far_layers=(1,)), i, attend)
        assert info["output_error"][1] <= info["output_error"][0] + 1e-6
        return fitted

    _fit_pass(path, config, record)
    assert seen_windows == {0: window, 1: window}


def test_far_fit_lowers_the_far_error(tiny_factory):
    """Adam with the far term (FitSettings.far) brings a compressed layer's far-only outputs closer to the
    source's than the fit without it does, and refuses to run without the source attention."""
    _, path = tiny_factory("llama")
    config = AutoConfig.from_pretrained(path)
    _, stream = _stream(path, None)
    layers = list(stream)
    far, errors = 6, {}

    def record(i, layer, x, z, attend):
        if i == 0:
            at = torch.arange(far + 1, x.shape[1])
            seen = output_fit.far_mask(x.shape[1], far)[far + 1 :]
            target = output_fit.far_targets(attend, x, far, 0, 8)
            fits = {}
            for name, settings in (("plain", FitSettings(steps=80)), ("far", FitSettings(steps=80, far=far, far_weight=4.0, far_queries=12))):
                fits[name], _ = fit_layer(config, layer, x.clone(), z.clone(), settings, 0, attend)
                with torch.no_grad():
                    out = mla_attention(config, fits[name], "cpu").outputs_at(x, at, seen)
                errors[name] = float((out - target).pow(2).sum() / target.pow(2).sum())
            with pytest.raises(ValueError, match="source attention"):
                fit_layer(config, layer, x.clone(), z.clone(), FitSettings(steps=2, far=far))
            # far_layers without this layer: the plain fit, exactly (and no source attention needed)
            other, _ = fit_layer(config, layer, x.clone(), z.clone(), FitSettings(steps=80, far=far, far_layers=(1,)), 0)
            for k in ("q_proj", "kv_a_proj", "kv_b_proj", "o_proj"):
                assert torch.equal(getattr(other, k), getattr(fits["plain"], k)), k
        return layer

    _fit_pass(path, config, record, layers)
    assert errors["far"] < errors["plain"], errors


def _fit_pass(path, config, record, layers=None, fit_ids=None) -> None:
    """Stream the tiny source through the fit callback `record` (fit_layer's signature): with its lossless
    layers (replicated, QK-norm pre-maps attached; 3 fit sequences of 24 tokens unless `fit_ids`), or with
    the given compressed `layers` (FIT_IDS unless `fit_ids`)."""
    from transmla.convert.calibrate import calibrated_layers

    if layers is None:
        def make(i, src, st):
            return attach_pre_maps(replicate(linear_source(src)), src)

        calib, default_fit = _ids(1, 2, 24), _ids(4, 3, 24)
    else:
        def make(i, src, st):
            return layers[i]

        calib, default_fit = _ids(1, 2, 32), FIT_IDS
    fit_ids = default_fit if fit_ids is None else fit_ids
    for _ in calibrated_layers(path, config, calib, make, fit_ids=fit_ids, fit_layer=record, progress=False):
        pass


def test_self_fit_lowers_the_error_of_each_token_reading_itself(tiny_factory):
    """The self term (FitSettings.self_weight): the source attention under self_mask equals an exact layer's
    outputs_at under it (fp32, 1e-5); Adam with the term brings a compressed layer's self-read outputs closer
    to the source's than the fit without it; it refuses to run without the source attention."""
    _, path = tiny_factory("llama")
    config = AutoConfig.from_pretrained(path)
    _, stream = _stream(path, None)
    layers = list(stream)
    errors = {}

    def exact(i, layer, x, z, attend):
        T = x.shape[1]
        attn = mla_attention(config, layer, "cpu", i)
        with torch.no_grad():
            target = output_fit.masked_targets(attend, x, output_fit.self_mask(T), 0, 2)
            out = attn.outputs_at(x, torch.arange(T), output_fit.self_mask(T))
        torch.testing.assert_close(out, target, atol=1e-5 * float(target.abs().max()), rtol=1e-5)
        return layer

    _fit_pass(path, config, exact)

    def record(i, layer, x, z, attend):
        if i == 0:
            T = x.shape[1]
            target = output_fit.masked_targets(attend, x, output_fit.self_mask(T), 0, 8)
            for name, settings in (("plain", FitSettings(steps=80)), ("self", FitSettings(steps=80, self_weight=4.0, self_queries=12))):
                fitted, _ = fit_layer(config, layer, x.clone(), z.clone(), settings, 0, attend)
                with torch.no_grad():
                    out = mla_attention(config, fitted, "cpu").outputs_at(x, torch.arange(T), output_fit.self_mask(T))
                errors[name] = float((out - target).pow(2).sum() / target.pow(2).sum())
            with pytest.raises(ValueError, match="source attention"):
                fit_layer(config, layer, x.clone(), z.clone(), FitSettings(steps=2, self_weight=1.0))
        return layer

    _fit_pass(path, config, record, layers)
    assert errors["self"] < errors["plain"], errors


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_scores_fit_lowers_the_error_of_its_scores_over_the_source_values(tiny_factory, family):
    """The scores term (FitSettings.scores_weight): an exact layer's weights over the source's values, through the
    source's o_proj (MLAAttention.weights_over, SourceAttention.heads_output), equal the source attention's output
    (fp32, 1e-5; GQA heads, biases with qwen2); Adam with the term brings a compressed layer's scores-over-source-
    values output closer to the source's than the fit without it; it refuses without the source's tensors."""
    _, path = tiny_factory(family)
    config = AutoConfig.from_pretrained(path)
    _, stream = _stream(path, None)
    layers = list(stream)
    errors = {}

    def scores_output(layer, x, attend, i=0):
        T = x.shape[1]
        attn = mla_attention(config, layer, "cpu", i)
        with torch.no_grad():
            return attend.source.heads_output(attn.weights_over(x, torch.arange(T), attend.source.value_rows(x)))

    def exact(i, layer, x, z, attend):
        out = scores_output(layer, x, attend, i)
        torch.testing.assert_close(out, z, atol=1e-5 * float(z.abs().max()), rtol=1e-5)
        return layer

    _fit_pass(path, config, exact)

    def record(i, layer, x, z, attend):
        if i == 0:
            for name, settings in (("plain", FitSettings(steps=80)), ("scores", FitSettings(steps=80, scores_weight=4.0, scores_queries=12))):
                fitted, _ = fit_layer(config, layer, x.clone(), z.clone(), settings, 0, attend)
                out = scores_output(fitted, x, attend)
                errors[name] = float((out - z).pow(2).sum() / z.pow(2).sum())
            with pytest.raises(ValueError, match="source attention's values"):
                fit_layer(config, layer, x.clone(), z.clone(), FitSettings(steps=2, scores_weight=1.0), 0, attend.attention)
        return layer

    _fit_pass(path, config, record, layers)
    assert errors["scores"] < errors["plain"], errors


def test_cli_fit_has_the_far_term_on_the_middle_layers_at_half_the_cache(tiny_factory):
    """The CLI's fit (no FitSettings given): for a plan that keeps at least what --kv-budget 0.5 keeps, with fit
    sequences longer than FAR_TOKENS + 1, the far term runs on far_layers_for(L) only at FAR_WEIGHT (both
    recorded in the conversion's calibration); for a 25% plan, or on shorter sequences, it is off. Through the pipeline: layer 0
    (not a far layer) comes out bit-equal to the same plan's fit without the far term, layer 1 (a far layer)
    differs."""
    assert output_fit.far_layers_for(30) == tuple(range(15, 25))
    assert output_fit.far_layers_for(2) == (1,) and output_fit.far_layers_for(1) == (0,)
    # a source with sliding-window layers beside global ones: its global layers (every layer global: the rule above)
    assert output_fit.far_layers_for(18, (5, 11, 17)) == (5, 11, 17)
    assert output_fit.far_layers_for(2, (0, 1)) == (1,)
    _, path = tiny_factory("llama")
    config = AutoConfig.from_pretrained(path)
    half_plan = TransMLAPlan(kv_lora_rank=12, rope_dim=4, freqfold="auto")  # 16 of the source's 32 elements
    far = output_fit.FAR_TOKENS
    long_ids, short_ids = _ids(3, 2, far + 40), _ids(3, 2, far + 1)

    def stream(plan, fit_ids, fit=None):
        options = ConvertOptions.of(method="transmla", device="cpu", fit_steps=3)
        return LayerStream(get_method("transmla"), path, config, options, progress=False, calib_ids=_ids(1, 2, 32),
                           plan=plan, fit_ids=fit_ids, fit=fit)

    half = stream(half_plan, long_ids)
    assert half.fit.far == far and half.fit.far_layers == (1,) and half.fit.far_weight == output_fit.FAR_WEIGHT
    assert half.calibration["fit"]["far"] == far and half.calibration["fit"]["far_layers"] == [1]
    assert half.calibration["fit"]["far_weight"] == output_fit.FAR_WEIGHT != FitSettings(steps=3).far_weight
    for other in (stream(PLAN, long_ids), stream(half_plan, short_ids)):
        assert other.fit.far == 0 and "far" not in other.calibration["fit"]
    plain = stream(half_plan, long_ids, FitSettings(steps=3, bf16=half.fit.bf16, bf16_passes=half.fit.bf16_passes))
    with_far, without = list(half), list(plain)
    for k in ("q_proj", "kv_a_proj", "kv_b_proj", "o_proj"):
        assert torch.equal(getattr(with_far[0], k), getattr(without[0], k)), k
    assert not torch.equal(with_far[1].kv_b_proj, without[1].kv_b_proj)


def test_the_schedule_sets_adams_rate_at_each_step():
    """Warmup rises linearly to lr, the cosine falls to LR_FLOOR of it by the last step; constant stays."""
    cosine = FitSettings(steps=100, schedule="cosine", warmup=10)
    assert cosine.lr_factor(0) == pytest.approx(0.1 * (output_fit.LR_FLOOR + (1 - output_fit.LR_FLOOR)))
    assert cosine.lr_factor(9) == pytest.approx(output_fit.LR_FLOOR + (1 - output_fit.LR_FLOOR) * 0.5 * (1 + math.cos(math.pi * 0.09)))
    assert cosine.lr_factor(50) == pytest.approx(output_fit.LR_FLOOR + (1 - output_fit.LR_FLOOR) * 0.5)
    assert cosine.lr_factor(100) == pytest.approx(output_fit.LR_FLOOR)
    assert [FitSettings(steps=10).lr_factor(s) for s in (0, 9)] == [1.0, 1.0]
    with pytest.raises(ValueError, match="schedule must be one of constant, cosine, got 'linear'"):
        FitSettings(steps=10, schedule="linear")
    with pytest.raises(ValueError, match="warmup must be 0 or positive"):
        FitSettings(steps=10, warmup=-1)


def test_relative_rates_move_each_tensor_in_units_of_its_rms(tiny_factory):
    """With relative_lr, Adam's first step moves each weight by about lr x its tensor's RMS (Adam's first
    step is lr x sign(grad)); scaling every weight by 10 scales the step by 10, which absolute rates do not."""
    config, layer, x, z = _first_layer_io(tiny_factory, _ids(4, 8, 16))

    def first_step(layer, relative):
        attn = mla_attention(config, layer, "cpu")
        before = {k: v.detach().clone() for k, v in attn.named_parameters()}
        settings = FitSettings(steps=1, lr=1e-2 if relative else 1e-3, relative_lr=relative, closed_form=False)
        output_fit._adam_run(attn, x, z, torch.arange(x.shape[1])[None], 4, settings, settings.lr, check=False)
        return {k: (v.detach() - before[k]).abs().max() for k, v in attn.named_parameters()}, before

    for relative in (False, True):
        moved, before = first_step(layer, relative)
        big, _ = first_step(layer.with_tensors({k: v * 10 if k.endswith("proj.weight") else v
                                                for k, v in layer.state_dict("").items()}), relative)
        for name in ("q_proj.weight", "kv_b_proj.weight"):
            rms = float(before[name].pow(2).mean().sqrt())
            expected = 1e-2 * rms if relative else 1e-3
            assert moved[name] == pytest.approx(expected, rel=1e-3), name
            assert big[name] == pytest.approx(expected * (10 if relative else 1), rel=1e-3), name


def test_cli_fit_at_a_quarter_of_the_cache_has_relative_rates(tiny_factory):
    """The CLI's fit (no FitSettings given) at 25% of the cache and below takes RELATIVE_FIT (relative rates,
    warmup, cosine, 256 sampled queries; recorded in the conversion's calibration), at half the cache not; a
    conversion through the pipeline with it lowers the output error as the plain fit does."""
    _, path = tiny_factory("llama")
    config = AutoConfig.from_pretrained(path)
    half_plan = TransMLAPlan(kv_lora_rank=12, rope_dim=4, freqfold="auto")  # 16 of the source's 32 elements
    ids = _ids(3, 4, 64)

    def stream(plan):
        options = ConvertOptions.of(method="transmla", device="cpu", fit_steps=30)
        return LayerStream(get_method("transmla"), path, config, options, progress=False, calib_ids=_ids(1, 2, 32),
                           plan=plan, fit_ids=ids)

    quarter, half = stream(PLAN), stream(half_plan)
    expected = FitSettings(steps=30, seed=0, bf16=quarter.fit.bf16, bf16_passes=quarter.fit.bf16, **output_fit.RELATIVE_FIT)
    assert quarter.fit == expected and quarter.fit.queries == 256 and quarter.fit.relative_lr
    assert {k: quarter.calibration["fit"][k] for k in ("relative_lr", "schedule", "warmup", "queries")} == {
        "relative_lr": True, "schedule": "cosine", "warmup": 10, "queries": 256}
    assert not half.fit.relative_lr and half.fit.schedule == "constant" and "relative_lr" not in half.calibration["fit"]
    list(quarter)
    errors = [info["output_error"] for info in quarter.infos]
    assert all(after < before for before, after in errors), errors


def test_fit_jobs_fit_layers_in_worker_processes_as_one_thread_would(tiny_factory):
    """fit_jobs 2: each layer's fit runs in a worker process (one thread) while the stream goes on; the layers come
    out in order, every tensor and record equal to a one-thread conversion's in this process, the far term's
    source attention included (it reaches the worker pickled). fit_jobs below 1 is refused."""
    _, path = tiny_factory("llama")
    config = AutoConfig.from_pretrained(path)
    half_plan = TransMLAPlan(kv_lora_rank=12, rope_dim=4, freqfold="auto")  # layer 1 fits the far term
    ids = _ids(3, 2, output_fit.FAR_TOKENS + 40)

    def stream(jobs):
        options = ConvertOptions.of(method="transmla", device="cpu", fit_steps=3, fit_jobs=jobs)
        return LayerStream(get_method("transmla"), path, config, options, progress=False, calib_ids=_ids(1, 2, 32),
                           plan=half_plan, fit_ids=ids)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = stream(1)
        one_layers = list(one)
    finally:
        torch.set_num_threads(threads)
    two = stream(2)
    assert two.fit.far and two._fit_jobs() == 2
    two_layers = list(two)
    assert len(two_layers) == len(one_layers) == config.num_hidden_layers
    for a, b in zip(one_layers, two_layers):
        assert a.state_dict("").keys() == b.state_dict("").keys()
        for k, v in a.state_dict("").items():
            assert torch.equal(v, b.state_dict("")[k]), k
    assert two.infos == one.infos and all("output_error" in info for info in two.infos)
    with pytest.raises(ValueError, match="fit_jobs must be at least 1, got 0"):
        ConvertOptions.of(method="transmla", device="cpu", fit_jobs=0)


def test_bf16_passes_only_where_the_conversion_compresses():
    """The CLI's fit runs its closed forms, far targets and the source streams in bf16 only where bf16 pays and
    the conversion compresses: an uncompressed (possibly exact) conversion keeps them in fp32 so that an exact
    layer is seen exact."""
    def settings(bf16, cache):
        return output_fit.default_fit_settings(10, 0, bf16, cache, 32, 2, 64)

    assert settings(True, 8).bf16_passes and settings(True, 8).bf16
    assert not settings(True, 32).bf16_passes and settings(True, 32).bf16
    assert not settings(False, 8).bf16_passes and not settings(True, None).bf16_passes


def test_bf16_streams_give_the_fit_the_source_io_to_bf16_rounding(tiny_factory):
    """calibrated_layers(bf16=True): the source layers' forward passes under bf16 autocast, so the fit's x and z
    are the fp32 ones to bf16's rounding (and not bit-equal: the products really ran in bf16)."""
    from transmla.convert.calibrate import calibrated_layers

    _, path = tiny_factory("llama")
    config = AutoConfig.from_pretrained(path)
    fit_ids = _ids(6, 3, 16)

    def collected(bf16):
        got = {}

        def record(i, layer, x, z, attend):
            got[i] = (x.clone(), z.clone())
            return layer

        for _ in calibrated_layers(path, config, _ids(1, 4, 16), lambda i, src, st: replicate(src), fit_ids=fit_ids,
                                   fit_layer=record, progress=False, bf16=bf16):
            pass
        return got

    exact, rounded = collected(False), collected(True)
    # layer 0's input: the embeddings' norm, before any product, only stored in bf16 (calibrate.fit_storage_dtype)
    assert torch.equal(rounded[0][0], exact[0][0].bfloat16())
    for i in exact:
        for k, (want, got) in enumerate(zip(exact[i], rounded[i])):
            assert want.dtype == torch.float32 and got.dtype == torch.bfloat16
            assert i == 0 and k == 0 or not torch.equal(got, want.bfloat16())
            assert float((got.float() - want).norm() / want.norm()) < 3e-2


def test_bf16_passes_fit_the_same_layers_from_bf16_storage(tiny_factory, monkeypatch):
    """With bf16 passes the fit's x, z and far targets are held in bfloat16 (half the memory): the fitted layers
    equal, bit for bit, those of the same fit from float32 copies of the same values (every pass that reads them
    rounds them to bf16 as storing does), through the closed forms, Adam and the far term."""
    from transmla.convert import calibrate

    _, path = tiny_factory("llama")
    config = AutoConfig.from_pretrained(path)
    half_plan = TransMLAPlan(kv_lora_rank=12, rope_dim=4, freqfold="auto")
    far = 8
    settings = FitSettings(steps=4, bf16=True, bf16_passes=True, far=far, far_layers=(1,), queries=16)
    seen = []
    fit_layer_of = output_fit.fit_layer

    def recording(config, layer, x, z, settings, index=0, source_attention=None):
        seen.append((x.dtype, z.dtype))
        return fit_layer_of(config, layer, x, z, settings, index, source_attention)

    def layers():
        options = ConvertOptions.of(method="transmla", device="cpu", fit_steps=4)
        return list(LayerStream(get_method("transmla"), path, config, options, progress=False,
                                calib_ids=_ids(1, 2, 32), plan=half_plan, fit_ids=_ids(3, 4, 48), fit=settings))

    monkeypatch.setattr("transmla.convert.pipeline.fit_layer", recording)
    stored = layers()
    assert seen == [(torch.bfloat16, torch.bfloat16)] * 2
    monkeypatch.setattr(calibrate, "fit_storage_dtype", lambda bf16: torch.float32)
    seen.clear()
    copied = layers()
    assert seen == [(torch.float32, torch.float32)] * 2
    for a, b in zip(stored, copied):
        for k, v in a.state_dict("").items():
            assert torch.equal(v, b.state_dict("")[k]), k


def test_bf16_closed_forms_give_the_fp32_fit_to_bf16_rounding(tiny_factory):
    """The closed forms under bf16 autocast (float32 sums per batch): the errors they report, and the fp32 error of
    the o_proj they solve for, are the fp32 closed form's to bf16's rounding."""
    source, path = tiny_factory("llama")
    config, stream = _stream(path, None)
    layer = next(iter(stream))
    x, z = _source_io(source, 0, FIT_IDS)
    pos = torch.arange(x.shape[1])[None]
    results = []
    for bf16 in (False, True):
        attn = mla_attention(config, layer, "cpu")
        errors = refit_o_proj_errors(attn, x.clone(), z.clone(), pos, 16, None, bf16)
        results.append((errors, output_error(attn, x, z, pos, 16)))  # the solution's error in fp32
    ((before, after), solved), ((before_bf16, after_bf16), solved_bf16) = results
    assert after < before and abs(before_bf16 - before) < 0.02 * before and abs(after_bf16 - after) < 0.05 * after
    assert solved == pytest.approx(after, rel=1e-4) and solved <= solved_bf16 < 1.05 * solved
