"""dtypes.fast_bf16_matmul: where the output fit and the recipes run under bf16."""

import torch

from transmla import dtypes


def _cpu(monkeypatch, amx: bool, avx512_bf16: bool, speedup: float) -> list:
    probed = []
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(dtypes, "cpu_bf16_speedup", lambda: probed.append(1) or speedup)
    return probed


def test_amx_takes_bf16_without_a_probe(monkeypatch):
    probed = _cpu(monkeypatch, amx=True, avx512_bf16=True, speedup=0.5)
    assert dtypes.fast_bf16_matmul("cpu") and not probed


def test_avx512_bf16_takes_bf16_only_where_measured_faster(monkeypatch):
    probed = _cpu(monkeypatch, amx=False, avx512_bf16=True, speedup=dtypes.BF16_PROBE_SPEEDUP * 1.1)
    assert dtypes.fast_bf16_matmul("cpu") and probed == [1]
    probed = _cpu(monkeypatch, amx=False, avx512_bf16=True, speedup=0.7)
    assert not dtypes.fast_bf16_matmul("cpu") and probed == [1]


def test_without_bf16_instructions_fp32_and_no_probe(monkeypatch):
    probed = _cpu(monkeypatch, amx=False, avx512_bf16=False, speedup=10.0)
    assert not dtypes.fast_bf16_matmul("cpu") and not probed


def test_probe_measures_a_positive_ratio_once():
    dtypes.cpu_bf16_speedup.cache_clear()
    first = dtypes.cpu_bf16_speedup()
    assert first > 0 and dtypes.cpu_bf16_speedup() == first  # cached: one measurement a process
