"""The one kernel dispatch (mla/kernels/backends.py): a toy backend registered in one call carries the model's
absorbed attention, decode steps and prompts, with the reference's numbers; TRANSMLA_KERNEL forces a backend."""

from __future__ import annotations

import pytest
import torch

from transmla.mla.kernels import backends
from transmla.mla.kernels.backends import Backend, attend_rows, register, unregister
from transmla.mla.kernels.reference import mla_decode_reference

from test_fast_decode import random_mla_model, reference_logits


def reference_rows(q_rows, rows, d_c, softmax_scale, mask=None):
    """The PyTorch reference on packed rows (the queries are the last T positions; no padding mask)."""
    if mask is not None:
        return None  # not its call: the dispatch goes on to the next backend
    return mla_decode_reference(q_rows[..., :d_c], q_rows[..., d_c:], rows[..., :d_c], rows[..., d_c:], softmax_scale)


@pytest.fixture
def toy(monkeypatch):
    """A backend "toy" (the reference) registered first; [(phase, T)] of the calls it took."""
    monkeypatch.delenv(backends.ENV, raising=False)
    calls = []

    def entry(phase):
        def run(q_rows, rows, d_c, softmax_scale, mask):
            out = reference_rows(q_rows, rows, d_c, softmax_scale, mask)
            if out is not None:
                calls.append((phase, q_rows.shape[1]))
            return out
        return run

    register(Backend("toy", lambda q_rows, rows, mask: q_rows.device.type == "cpu",
                     decode=entry("decode"), prefill=entry("prefill")), before="triton")
    yield calls
    unregister("toy")


def test_builtin_backends_in_dispatch_order():
    assert [b.name for b in backends.backends()] == ["triton", "cpu", "torch", "sdpa"]


def test_the_model_attends_through_a_registered_backend(tiny_factory, toy):
    """generate() on a model whose 20-token prompt takes the folded prefill path: the prompt and every
    decode step run in the toy backend, and each step's logits equal a full pass in expanded attention."""
    model = random_mla_model(tiny_factory, narrow_latent=True)
    prompt = torch.randint(0, 97, (3, 20))
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        for step, logits in enumerate(out.logits):
            ref = reference_logits(model, out.sequences[:, : prompt.shape[1] + step])
            torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)
    layers = model.config.num_hidden_layers
    assert toy.count(("prefill", 20)) == layers and toy.count(("decode", 1)) == 3 * layers


@pytest.mark.parametrize("T", [1, 3, 12])
def test_attend_rows_gives_the_reference_numbers(toy, T):
    torch.manual_seed(T)
    q_rows, rows = torch.randn(2, T, 5, 24), torch.randn(2, 30, 24)
    out = attend_rows(q_rows, rows, 16, 0.3, fold_max_queries=8)
    torch.testing.assert_close(out, reference_rows(q_rows, rows, 16, 0.3), atol=1e-5, rtol=1e-5)
    assert toy == [("decode" if T <= 8 else "prefill", T)]


def test_the_environment_variable_forces_one_backend(toy, monkeypatch):
    """TRANSMLA_KERNEL=name: that backend alone is tried; what it does not take (here a padding mask) goes to
    "sdpa"; a name that is not registered is refused; the replaced variables are named in a warning."""
    register(Backend("toy-forced", lambda q_rows, rows, mask: True, decode=reference_rows, auto=False))
    try:
        q_rows, rows = torch.randn(1, 1, 3, 32), torch.randn(1, 10, 32)
        monkeypatch.setenv(backends.ENV, "toy-forced")
        assert backends.forced() == "toy-forced"
        torch.testing.assert_close(attend_rows(q_rows, rows, 16, 0.3), reference_rows(q_rows, rows, 16, 0.3))
        padding = torch.ones(1, 1, 1, 10, dtype=torch.bool)
        padding[..., :2] = False
        want = reference_rows(q_rows, rows[:, 2:], 16, 0.3)  # the padded rows dropped
        torch.testing.assert_close(attend_rows(q_rows, rows, 16, 0.3, padding), want, atol=1e-5, rtol=1e-5)
        assert toy == []  # forced: the auto backends are not tried
    finally:
        unregister("toy-forced")
    monkeypatch.setenv(backends.ENV, "no-such-backend")
    with pytest.raises(ValueError, match="TRANSMLA_KERNEL"):
        attend_rows(q_rows, rows, 16, 0.3)
    monkeypatch.setenv(backends.ENV, "auto")
    monkeypatch.setenv("TRANSMLA_CPU_KERNEL", "0")
    backends._warn_replaced.cache_clear()
    with pytest.warns(UserWarning, match="TRANSMLA_KERNEL=sdpa"):
        attend_rows(q_rows, rows, 16, 0.3)
