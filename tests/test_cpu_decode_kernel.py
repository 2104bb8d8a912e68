"""The decode kernels: the C one (mla/kernels/cpu_decode.c) equal to the reference absorbed decode in
fp32, the AMX one (cpu_decode_amx.c) to bf16 rounding, on odd shapes and strided caches, through
generate(); and without a compiler (or AMX) the SDPA path runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from transmla.mla.kernels import cpu_decode
from transmla.mla.kernels.backends import attend_rows
from transmla.mla.kernels.reference import mla_decode_reference

from test_fast_decode import random_mla_model, reference_logits


# The AMX kernels are built where the CPU has AMX-BF16 (CI's machine does); elsewhere their tests check the fallback.
HAS_AMX = "amx_bf16" in (Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else "")


def on_threads(threads: int, fn, *args):
    """fn(*args) with torch set to ``threads`` threads (the kernels split their work over them)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(old)


def _reference(q_rows, rows, d_c, scale):
    return mla_decode_reference(q_rows[..., :d_c], q_rows[..., d_c:], rows[..., :d_c], rows[..., d_c:], scale)


SHAPES = [(2, 1, 9, 96, 64), (3, 15, 9, 96, 64), (2, 64, 4, 32, 16), (2, 200, 5, 48, 32), (1, 5000, 9, 96, 64),
          (1, 4097, 3, 32, 16), (1, 1000, 12, 128, 80)]


@pytest.mark.parametrize("B,S,H,W,d_c", SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_equals_reference_decode(B, S, H, W, d_c, threads):
    """Odd head counts, lengths below / across / not a multiple of the 64-key tile, a cache with
    spare capacity (a strided view, as LatentCache hands it over), scores large enough to need the
    running max, and the work split over threads (by sequence, or one sequence's cache in parts)."""
    torch.manual_seed(S)
    rows = torch.randn(B, S + 9, W)[:, :S]  # [B, S, W], batch stride (S + 9) * W
    q_rows = torch.randn(B, 1, H, W) * 3
    out = on_threads(threads, cpu_decode.mla_decode_cpu, q_rows, rows, d_c, 0.2)
    assert out is not None, cpu_decode.KERNEL.status()
    assert out.shape == (B, 1, H, d_c)
    torch.testing.assert_close(out, _reference(q_rows, rows, d_c, 0.2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("B,S,H,W,d_c", SHAPES + [(2, 130, 16, 96, 64), (3, 63, 7, 80, 48)])
@pytest.mark.parametrize("threads", [1, 2])
def test_amx_kernel_matches_the_reference_to_bf16_rounding(B, S, H, W, d_c, threads):
    """bf16 queries and rows (fp32 accumulation, bf16 probabilities, output rounded to bf16): every
    output within 2^-8 of the float64 reference (relative to the largest), and no further from it than
    PyTorch's bf16 SDPA on the same inputs (x 1.25); the shapes of the fp32 test plus 16 heads (a full
    tile) and a width that ends in a 16-deep step; two threads split whole sequences (the same bits as
    one) or one sequence's cache in parts."""
    torch.manual_seed(S)
    rows = torch.randn(B, S + 9, W)[:, :S].bfloat16()  # [B, S, W], batch stride (S + 9) * W
    q_rows = (torch.randn(B, 1, H, W) * 3).bfloat16()
    out = on_threads(threads, cpu_decode.mla_decode_cpu, q_rows, rows, d_c, 0.2)
    if not HAS_AMX:
        assert out is None and cpu_decode.KERNEL.status("bf16")[(H, W, d_c)].startswith("unavailable: ")
        return
    assert out is not None, cpu_decode.KERNEL.status("bf16")
    assert out.shape == (B, 1, H, d_c) and out.dtype == torch.bfloat16
    ref = _reference(q_rows.double(), rows.double(), d_c, 0.2)
    err = (out.double() - ref).abs().max()
    assert err <= 2**-8 * ref.abs().max()
    sdpa = F.scaled_dot_product_attention(q_rows.reshape(B, 1, H, W), rows[:, None], rows[:, None], scale=0.2)
    assert err <= 1.25 * (sdpa[..., :d_c].double().reshape(ref.shape) - ref).abs().max()
    if B >= 2:
        assert torch.equal(out, on_threads(3 - threads, cpu_decode.mla_decode_cpu, q_rows, rows, d_c, 0.2))


def test_the_profiler_sees_the_kernels_by_name():
    """ctypes calls are invisible to torch's profiler: attend_rows names the decode and prefill kernels
    (what `bench generate --profile-steps` lists), and only while a profiler records."""
    from torch.profiler import ProfilerActivity, profile

    from transmla.mla.kernels import cpu_prefill

    rows = torch.randn(1, 40, 32)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        attend_rows(torch.randn(1, 1, 3, 32), rows, 16, 0.2)  # one new token: decode
        attend_rows(torch.randn(1, 40, 3, 32), rows, 16, 0.2, fold_max_queries=8)  # a prompt: prefill
    names = {e.key for e in prof.key_averages()}
    assert "transmla::cpu_decode_kernel" in names, (names, cpu_decode.KERNEL.status())
    assert "transmla::cpu_prefill_kernel" in names, (names, cpu_prefill.KERNEL.status())


def test_fp32_kernels_only_on_measured_vector_units(monkeypatch):
    """The product's choice (without the tests' fixture): the fp32 kernels take calls on a CPU with AVX-512F
    or AVX2 + FMA, or anywhere when TRANSMLA_KERNEL=cpu forces them; elsewhere attend_rows runs SDPA (the
    same result)."""
    from transmla.mla.kernels import cpu_build

    monkeypatch.undo()  # the real cpu_build.fp32_kernels_run
    flags = set(Path("/proc/cpuinfo").read_text().split())
    assert cpu_build.fast_vectors() == ("avx512f" in flags or {"avx2", "fma"} <= flags)  # this CPU's
    monkeypatch.delenv("TRANSMLA_KERNEL", raising=False)
    loads, load = [], cpu_decode.KERNEL.load
    monkeypatch.setattr(cpu_decode.KERNEL, "load", lambda *shape: loads.append(shape) or load(*shape))
    q_rows, rows = torch.randn(1, 1, 3, 32), torch.randn(1, 40, 32)
    for wide in (True, False):
        monkeypatch.setattr(cpu_build, "fast_vectors", lambda wide=wide: wide)
        assert cpu_decode.supports(q_rows, rows, 16) is wide
        loads.clear()
        out = attend_rows(q_rows, rows, 16, 0.2)
        assert bool(loads) is wide  # the kernel ran, or SDPA did
        torch.testing.assert_close(out, mla_decode_reference(q_rows[..., :16], q_rows[..., 16:], rows[..., :16], rows[..., 16:], 0.2), rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("TRANSMLA_KERNEL", "cpu")  # forced: on any CPU
    assert cpu_decode.supports(q_rows, rows, 16)


def test_kernel_refuses_what_it_does_not_cover():
    rows = torch.randn(2, 10, 32)
    assert not cpu_decode.supports(torch.randn(2, 2, 3, 32), rows, 16)  # two query tokens
    assert not cpu_decode.supports(torch.randn(2, 1, 17, 32).bfloat16(), rows.bfloat16(), 16)  # bf16, > 16 heads
    assert not cpu_decode.supports(torch.randn(2, 1, 3, 32).half(), rows.half(), 16)  # fp16
    assert cpu_decode.supports(torch.randn(2, 1, 16, 32).bfloat16(), rows.bfloat16(), 16)
    assert not cpu_decode.supports(torch.randn(2, 1, 3, 32), rows, 10)  # d_c not a multiple of 16
    assert not cpu_decode.supports(torch.randn(2, 1, 3, 40), torch.randn(2, 10, 40), 16)  # width
    assert cpu_decode.supports(torch.randn(2, 1, 3, 32), rows, 16)


def without_kernel_cache(monkeypatch, tmp_path, kernel=cpu_decode.KERNEL):
    """Kernels built into tmp_path from now on; ``kernel``'s loaded shapes forgotten."""
    monkeypatch.setenv("TRANSMLA_CACHE", str(tmp_path))
    kernel.forget()


def test_no_compiler_falls_back_to_sdpa_with_the_reason(monkeypatch, tmp_path):
    without_kernel_cache(monkeypatch, tmp_path)
    monkeypatch.setenv("CC", "no-such-compiler-here")
    try:
        q_rows, rows = torch.randn(2, 1, 3, 32), torch.randn(2, 20, 32)
        assert cpu_decode.mla_decode_cpu(q_rows, rows, 16, 0.3) is None
        assert "no-such-compiler-here" in cpu_decode.KERNEL.status()[(3, 32, 16)]
        out = attend_rows(q_rows, rows, 16, 0.3)  # the SDPA path
        torch.testing.assert_close(out, _reference(q_rows, rows, 16, 0.3), atol=1e-5, rtol=1e-5)
        assert not list(tmp_path.rglob("*.so"))  # nothing half-built left behind
    finally:
        cpu_decode.KERNEL.forget()


def test_a_failing_build_leaves_nothing_and_the_env_switch_turns_it_off(monkeypatch, tmp_path):
    without_kernel_cache(monkeypatch, tmp_path)
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    monkeypatch.setitem(cpu_decode.KERNEL.sources, "fp32", bad)
    try:
        assert cpu_decode.KERNEL.load("fp32", 3, 32, 16) is None
        assert cpu_decode.KERNEL.status()[(3, 32, 16)].startswith("unavailable: ")
        assert [p.name for p in (tmp_path / "kernels").iterdir()] == []
    finally:
        cpu_decode.KERNEL.forget()
    calls, original = [], cpu_decode.mla_decode_cpu
    monkeypatch.setattr(cpu_decode, "mla_decode_cpu", lambda *a: calls.append(1) or original(*a))
    monkeypatch.setenv("TRANSMLA_KERNEL", "sdpa")  # the model's attention stays off the kernels
    q_rows, rows = torch.randn(2, 1, 3, 32), torch.randn(2, 10, 32)
    torch.testing.assert_close(attend_rows(q_rows, rows, 16, 0.3), _reference(q_rows, rows, 16, 0.3))
    assert calls == []


def test_generate_through_the_kernel_equals_the_full_forward(tiny_factory):
    """A model whose rows fit the kernel (d_c 16, d_r 16): greedy generate() for several steps, each
    step's logits equal a full causal pass without a cache (expanded attention), fp32 1e-5."""
    model = random_mla_model(tiny_factory, d_c=16, d_r=16)
    calls = []
    original = cpu_decode.KERNEL.load

    def counted(*shape):  # (dtype, rows, width, d_c)
        calls.append(shape)
        return original(*shape)

    prompt = torch.randint(0, 97, (3, 70))  # past one 64-key tile
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_decode.KERNEL, "load", counted)
        out = model.generate(prompt, max_new_tokens=5, min_new_tokens=5, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    assert calls and set(calls) == {("fp32", 6, 32, 16)} and original("fp32", 6, 32, 16) is not None
    with torch.no_grad():
        for step, logits in enumerate(out.logits):
            ref = reference_logits(model, out.sequences[:, : prompt.shape[1] + step])
            torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)


def test_bf16_generate_through_the_amx_kernel(tiny_factory, monkeypatch):
    """A bf16 model whose rows fit the kernels: greedy generate() for several steps after a 70-token
    prompt runs its decode steps through the AMX kernel where it builds; each step's logits agree with
    the same steps on PyTorch's SDPA (TRANSMLA_KERNEL=sdpa) to bf16 precision and stay as near the fp32
    model's as SDPA's."""
    model = random_mla_model(tiny_factory, d_c=16, d_r=16)
    prompt = torch.randint(0, 97, (3, 70))
    kwargs = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
    with torch.no_grad():
        exact = model.generate(prompt, **kwargs)
    model = model.bfloat16()
    calls, original = [], cpu_decode.mla_decode_cpu

    def counted(q_rows, rows, d_c, scale):
        out = original(q_rows, rows, d_c, scale)
        calls.append((q_rows.dtype, out is not None))
        return out

    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_decode, "mla_decode_cpu", counted)
        fast = model.generate(prompt, **kwargs)
    assert calls and set(calls) == {(torch.bfloat16, HAS_AMX)}
    assert HAS_AMX == (cpu_decode.KERNEL.status("bf16").get((6, 32, 16)) == "compiled")
    monkeypatch.setenv("TRANSMLA_KERNEL", "sdpa")
    with torch.no_grad():
        sdpa = model.generate(prompt, **kwargs)
    assert torch.equal(fast.sequences, sdpa.sequences)
    for f, s, e in zip(fast.logits, sdpa.logits, exact.logits):
        scale = e.abs().max()
        assert (f.float() - s.float()).abs().max() <= 0.02 * scale
        assert (f.float() - e).abs().max() <= 1.25 * (s.float() - e).abs().max() + 1e-3 * scale
