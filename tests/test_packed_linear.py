"""PackedCPULinear (oneDNN-prepacked weights for the CPU's decode linears) equals F.linear, takes the
packed path only where it should, follows weight changes, and leaves generate() unchanged."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from transmla.mla.packed_linear import (
    FP32_MAX_ROWS,
    FP32_MIN_ROWS,
    PackedCPULinear,
    onednn_linear_available,
    onednn_packs,
    use_packed_linears,
)

from test_fast_decode import random_mla_model

needs_onednn = pytest.mark.skipif(not onednn_linear_available(), reason="this torch build has no oneDNN linear ops")


def test_x86_wheels_have_the_ops():
    """The path must not silently vanish on the machines it is measured on."""
    if platform.machine() in ("x86_64", "AMD64"):
        assert onednn_linear_available()


def packed(in_f: int, out_f: int, dtype: torch.dtype, bias: bool = True) -> PackedCPULinear:
    torch.manual_seed(0)
    lin = nn.Linear(in_f, out_f, bias=bias).to(dtype)
    use_packed_linears(lin)
    assert isinstance(lin, PackedCPULinear)
    return lin


@needs_onednn
@pytest.mark.parametrize("shape", [(FP32_MIN_ROWS, 40), (8, 40), (2, 3, 40), (FP32_MAX_ROWS, 40)])
@pytest.mark.parametrize("bias", [True, False])
def test_fp32_packed_equals_f_linear(shape, bias):
    lin = packed(40, 72, torch.float32, bias)
    x = torch.randn(*shape)
    with torch.no_grad():
        out = lin(x)
    assert lin._pack is not None  # the packed path ran
    torch.testing.assert_close(out, F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)


@needs_onednn
@pytest.mark.parametrize("rows", [1, FP32_MIN_ROWS - 1, FP32_MAX_ROWS + 1])
def test_fp32_outside_its_rows_stays_plain(rows):
    """fp32 matrix-vector products and GEMMs above FP32_MAX_ROWS stay on F.linear (faster there)."""
    lin = packed(40, 72, torch.float32)
    x = torch.randn(rows, 40)
    with torch.no_grad():
        out = lin(x)
    assert lin._pack is None
    assert torch.equal(out, F.linear(x, lin.weight, lin.bias))


@needs_onednn
def test_bf16_any_rows():
    """bf16 packs at any row count where oneDNN packs bf16 (AVX-512 or AVX-NE-CONVERT); elsewhere (an
    AVX2-only CPU, where oneDNN's reorder raises) it stays F.linear, and a model's linears stay off."""
    lin = packed(40, 72, torch.bfloat16)
    can = onednn_packs(torch.bfloat16)
    with torch.no_grad():
        lin(torch.randn(1, 40).to(torch.bfloat16))
    assert (lin._pack is not None) == can
    x = torch.randn(3, 64, 40).to(torch.bfloat16)
    with torch.no_grad():
        out = lin(x)
    assert (lin._pack is not None) == can
    torch.testing.assert_close(out.float(), F.linear(x, lin.weight, lin.bias).float(), atol=2e-2, rtol=2e-2)
    model = nn.Sequential(nn.Linear(40, 72)).to(torch.bfloat16)
    assert use_packed_linears(model) == (1 if can else 0) and model.packed_linears == can


def test_bf16_packing_is_probed_not_assumed():
    """onednn_packs answers by trying oneDNN's reorder: here it must agree with the CPU's flags."""
    flags = set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    if not onednn_linear_available():
        assert not onednn_packs(torch.bfloat16)
    elif {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags:
        assert onednn_packs(torch.bfloat16)
    elif flags:
        assert not onednn_packs(torch.bfloat16), flags
    assert onednn_packs(torch.float32) == onednn_linear_available() and not onednn_packs(torch.float16)


@needs_onednn
def test_non_contiguous_input():
    lin = packed(40, 72, torch.float32)
    x = torch.randn(4, 80)[:, ::2]  # a strided view
    with torch.no_grad():
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)


def test_autograd_takes_f_linear():
    lin = packed(40, 72, torch.float32)
    x = torch.randn(2, 40, requires_grad=True)
    lin(x).sum().backward()
    assert lin._pack is None and lin.weight.grad is not None and x.grad is not None


@needs_onednn
def test_weight_change_repacks():
    """An in-place update (an optimizer step, load_state_dict) and a dtype change both invalidate the pack."""
    lin = packed(40, 72, torch.float32)
    x = torch.randn(FP32_MIN_ROWS, 40)
    with torch.no_grad():
        first = lin(x)
        lin.weight.mul_(2)
        torch.testing.assert_close(lin(x) - lin.bias, 2 * (first - lin.bias), atol=1e-5, rtol=1e-5)
        lin.load_state_dict({"weight": torch.zeros(72, 40), "bias": torch.ones(72)})
        assert torch.equal(lin(x), torch.ones(FP32_MIN_ROWS, 72))
        lin.to(torch.bfloat16)  # packed again where oneDNN packs bf16, else F.linear
        torch.testing.assert_close(lin(x.bfloat16()).float(), torch.ones(FP32_MIN_ROWS, 72))
        assert (lin._pack_key[1] == torch.bfloat16) == onednn_packs(torch.bfloat16)


def test_disabled_keeps_no_pack():
    lin = packed(40, 72, torch.float32)
    use_packed_linears(lin, enabled=False)
    with torch.no_grad():
        lin(torch.randn(8, 40))
    assert lin._pack is None


@needs_onednn
def test_generate_with_packed_linears_equals_plain(tiny_factory):
    """A random MLA model's greedy decode: generate() turns the packs on by itself; packed against
    plain linears: same tokens, logits to 1e-5; a model switched off stays off."""
    model = random_mla_model(tiny_factory, bias=True)
    assert getattr(model, "packed_linears", None) is None
    keys = set(model.state_dict())
    prompt = torch.randint(0, 97, (FP32_MIN_ROWS, 7))  # decode steps of FP32_MIN_ROWS rows pack
    kwargs = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        fast = model.generate(prompt, **kwargs)
        assert model.packed_linears is True
        assert any(m._pack is not None for m in model.modules() if isinstance(m, PackedCPULinear))
        assert use_packed_linears(model, enabled=False) == 0
        plain = model.generate(prompt, **kwargs)
        assert model.packed_linears is False
        assert all(m._pack is None for m in model.modules() if isinstance(m, PackedCPULinear))
    assert set(model.state_dict()) == keys  # the packs are not state
    assert torch.equal(fast.sequences, plain.sequences)
    for a, b in zip(fast.logits, plain.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@needs_onednn
def test_packing_only_where_the_copy_fits(monkeypatch):
    """The packed copies must fit in half the available memory, else the linears stay plain."""
    import transmla.mla.packed_linear as pl

    model = nn.Sequential(nn.Linear(40, 72), nn.Linear(72, 40))  # 2 x 11,520 weight bytes
    monkeypatch.setattr(pl, "available_memory_bytes", lambda: 2 * 23_040)
    assert use_packed_linears(model) == 0 and model.packed_linears is False
    with torch.no_grad():
        model(torch.randn(8, 40))
    assert all(m._pack is None for m in model)
    monkeypatch.setattr(pl, "available_memory_bytes", lambda: 2 * 23_040 + 2)
    assert use_packed_linears(model) == 2 and model.packed_linears is True
