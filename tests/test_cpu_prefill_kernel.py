"""The C prefill kernels: cpu_prefill.c equal to the reference absorbed attention in fp32 for many causal
query tokens (a whole prompt, or a chunk after cached tokens), on odd shapes, strided caches and one or
two threads; the bf16 AMX kernel (cpu_prefill_amx.c) on the same shapes within bf16's rounding, no
further from the float64 reference than PyTorch's bf16 SDPA; both through a model's prefill; and
without a compiler the SDPA path runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from transmla.mla.kernels import cpu_prefill
from transmla.mla.kernels.backends import attend_rows
from transmla.mla.kernels.reference import mla_decode_reference
from transmla.mla.latent_cache import LatentCache, cache_kwargs

from test_cpu_decode_kernel import HAS_AMX, on_threads, without_kernel_cache
from test_fast_decode import random_mla_model, reference_logits


def _reference(q_rows, rows, d_c, scale):
    """The reference in float64 (the kernel and an fp32 reference each differ from it by ~1e-5)."""
    q, r = q_rows.double(), rows.double()
    return mla_decode_reference(q[..., :d_c], q[..., d_c:], r[..., :d_c], r[..., d_c:], scale).float()


SHAPES = [(2, 9, 9, 9, 96, 64), (1, 16, 16, 3, 32, 16), (2, 17, 17, 5, 48, 32),
          (3, 65, 65, 9, 96, 64), (2, 65, 100, 9, 96, 64), (1, 1, 70, 4, 32, 16),
          (1, 200, 200, 12, 128, 80), (1, 130, 300, 7, 64, 48)]


@pytest.mark.parametrize("B,T,S,H,W,d_c", SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_equals_reference_attention(B, T, S, H, W, d_c, threads):
    """Head counts that leave a partial register tile, prompts below / across / not a multiple of the
    16-token query block and the 64-key block, queries after cached tokens (T < S: the causal limit is
    bottom-right), a cache with spare capacity (a strided view, as LatentCache hands it over), scores
    large enough to need the running max, and the query blocks dealt out to two threads."""
    torch.manual_seed(T * S)
    rows = torch.randn(B, S + 9, W)[:, :S]  # [B, S, W], batch stride (S + 9) * W
    q_rows = torch.randn(B, T, H, W) * 2
    out = on_threads(threads, cpu_prefill.mla_prefill_cpu, q_rows, rows, d_c, 0.2)
    assert out is not None, cpu_prefill.KERNEL.status()
    assert out.shape == (B, T, H, d_c)
    torch.testing.assert_close(out, _reference(q_rows, rows, d_c, 0.2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("B,T,S,H,W,d_c", SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_amx_kernel_matches_the_reference_to_bf16_rounding(B, T, S, H, W, d_c, threads):
    """bf16 queries and rows (fp32 accumulation, bf16 probabilities and output): every output within
    2^-8 of the float64 reference (relative to the largest), and no further from it than PyTorch's
    bf16 SDPA on the same inputs (x 1.25); one or two threads give the same bits."""
    torch.manual_seed(T * S)
    rows = torch.randn(B, S + 9, W)[:, :S].bfloat16()  # [B, S, W], batch stride (S + 9) * W
    q_rows = (torch.randn(B, T, H, W) * 2).bfloat16()
    out = on_threads(threads, cpu_prefill.mla_prefill_cpu, q_rows, rows, d_c, 0.2)
    if not HAS_AMX:
        assert out is None and cpu_prefill.KERNEL.status("bf16")[(H, W, d_c)].startswith("unavailable: ")
        return
    assert out is not None, cpu_prefill.KERNEL.status("bf16")
    assert out.shape == (B, T, H, d_c) and out.dtype == torch.bfloat16
    ref = _reference(q_rows, rows, d_c, 0.2).double()
    err = (out.double() - ref).abs().max()
    assert err <= 2**-8 * ref.abs().max()
    limit = torch.arange(T)[:, None] + (S - T)
    mask = torch.arange(S)[None, :] <= limit  # [T, S]
    sdpa = F.scaled_dot_product_attention(q_rows.transpose(1, 2), rows[:, None], rows[:, None], attn_mask=mask,
                                          scale=0.2, enable_gqa=True)[..., :d_c].transpose(1, 2)
    assert err <= 1.25 * (sdpa.double() - ref).abs().max()
    assert torch.equal(out, on_threads(3 - threads, cpu_prefill.mla_prefill_cpu, q_rows, rows, d_c, 0.2))


def test_kernel_refuses_what_it_does_not_cover():
    rows = torch.randn(2, 40, 32)
    q = torch.randn(2, 20, 3, 32)
    assert cpu_prefill.supports(q, rows, 16)
    assert cpu_prefill.supports(q.bfloat16(), rows.bfloat16(), 16)  # the AMX kernel's (where it builds)
    assert not cpu_prefill.supports(q.half(), rows.half(), 16)  # fp16
    assert not cpu_prefill.supports(q.bfloat16(), rows, 16)  # mixed dtypes
    assert not cpu_prefill.supports(q, rows, 10)  # d_c not a multiple of 16
    assert not cpu_prefill.supports(torch.randn(2, 20, 3, 40), torch.randn(2, 40, 40), 16)  # width
    assert not cpu_prefill.supports(torch.randn(2, 50, 3, 32), rows, 16)  # more queries than rows
    assert not cpu_prefill.supports(q.requires_grad_(), rows, 16)  # autograd: the kernel has no backward
    with torch.no_grad():
        assert cpu_prefill.supports(q, rows, 16)


def test_no_compiler_falls_back_to_sdpa(monkeypatch, tmp_path):
    without_kernel_cache(monkeypatch, tmp_path, cpu_prefill.KERNEL)
    monkeypatch.setenv("CC", "no-such-compiler-here")
    try:
        q_rows, rows = torch.randn(2, 20, 3, 32), torch.randn(2, 20, 32)
        assert cpu_prefill.mla_prefill_cpu(q_rows, rows, 16, 0.3) is None
        assert "no-such-compiler-here" in cpu_prefill.KERNEL.status()[(3, 32, 16)]
        out = attend_rows(q_rows, rows, 16, 0.3)  # the SDPA path
        torch.testing.assert_close(out, _reference(q_rows, rows, 16, 0.3), atol=1e-5, rtol=1e-5)
        assert not list(tmp_path.rglob("*.so"))
    finally:
        cpu_prefill.KERNEL.forget()


def counting_kernel_calls():
    """([], the prefill entry point recording (T, S, ran) of each call into that list)."""
    calls, original = [], cpu_prefill.mla_prefill_cpu

    def counted(q_rows, rows, d_c, scale):
        out = original(q_rows, rows, d_c, scale)
        calls.append((q_rows.shape[1], rows.shape[1], out is not None))
        return out

    return calls, counted


def test_prefill_and_a_chunk_through_the_kernel_equal_the_full_forward(tiny_factory):
    """A model whose rows fit the kernel (d_c 16, d_r 16): a 70-token prompt, then a 30-token chunk on
    top of the cache; the logits at the chunk's positions equal full causal passes without a cache
    (expanded attention), fp32 1e-5, and the kernel ran for both calls."""
    model = random_mla_model(tiny_factory, d_c=16, d_r=16)
    ids = torch.randint(0, 97, (2, 100))
    calls, counted = counting_kernel_calls()

    cache = LatentCache(model.config.num_hidden_layers, 100)
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_prefill, "mla_prefill_cpu", counted)
        model(ids[:, :70], **cache_kwargs(cache), use_cache=True)
        chunk = model(ids[:, 70:], **cache_kwargs(cache), use_cache=True).logits  # [2, 30, vocab]
    assert set(calls) == {(70, 70, True), (30, 100, True)}
    with torch.no_grad():
        for pos in (70, 85, 99):
            torch.testing.assert_close(chunk[:, pos - 70], reference_logits(model, ids[:, : pos + 1]),
                                       atol=1e-5, rtol=1e-5)


def test_bf16_prefill_and_a_chunk_through_the_amx_kernel(tiny_factory, monkeypatch):
    """A bf16 model whose rows fit the kernels: a 70-token prompt, then a 30-token chunk on its cache, run
    through the AMX kernel where it builds; the chunk's logits agree with the same calls on PyTorch's
    SDPA (TRANSMLA_KERNEL=sdpa) to bf16 precision, and both stay near the fp32 model's."""
    model = random_mla_model(tiny_factory, d_c=16, d_r=16)
    ids = torch.randint(0, 97, (2, 100))
    calls, counted = counting_kernel_calls()

    def chunk_logits(m):
        cache = LatentCache(m.config.num_hidden_layers, 100)
        with torch.no_grad():
            m(ids[:, :70], **cache_kwargs(cache), use_cache=True)
            return m(ids[:, 70:], **cache_kwargs(cache), use_cache=True).logits.float()  # [2, 30, vocab]

    exact = chunk_logits(model)
    model = model.bfloat16()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_prefill, "mla_prefill_cpu", counted)
        fast = chunk_logits(model)
    assert set(calls) == {(70, 70, HAS_AMX), (30, 100, HAS_AMX)}
    monkeypatch.setenv("TRANSMLA_KERNEL", "sdpa")
    sdpa = chunk_logits(model)
    scale = exact.abs().max()
    assert (fast - sdpa).abs().max() <= 0.02 * scale
    assert (fast - exact).abs().max() <= 1.25 * (sdpa - exact).abs().max() + 1e-3 * scale
