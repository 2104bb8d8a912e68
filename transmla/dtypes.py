"""Names users give for dtypes and devices, turned into torch objects in one place."""

from __future__ import annotations

import functools
import time

import torch

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEVICES = ("auto", "cpu", "cuda")


def torch_dtype(name: str) -> torch.dtype:
    """fp32 | bf16 | fp16 -> the torch dtype; ValueError naming the choices otherwise."""
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def pick_device(device: str) -> str:
    """auto -> cuda when a GPU is present, else cpu; cuda without a GPU is an error."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda asked for, but no CUDA GPU is available")
    return device


def fast_bf16_matmul(device: str) -> bool:
    """Whether bf16 matrix products pay on `device`: a CUDA GPU with bf16; a CPU with AMX tiles; a CPU with
    AVX-512 BF16 where a measured bf16 product is at least BF16_PROBE_SPEEDUP times faster than fp32. The
    flag alone does not settle it: oneDNN's bf16 training passes ran 1.3-1.4x slower than fp32 on a Xeon
    with AVX-512 BF16 and no AMX, and about 4x faster on an AMD EPYC with it (benchmarks/results/fit_cost.md)."""
    if device.startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
        return True
    return bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()) and cpu_bf16_speedup() >= BF16_PROBE_SPEEDUP


BF16_PROBE_SPEEDUP = 1.5  # far from both CPUs measured (0.7x and 4x): load on the machine does not flip it


@functools.cache
def cpu_bf16_speedup() -> float:
    """fp32 time over bf16-autocast time of one product and its backward at the output fit's shapes
    (2048 x 576 @ 576 x 576, the best of 3 after a warm-up), on torch's current threads; once a process."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(2048, 576, generator=gen, requires_grad=True)  # [tokens, in]
    w = torch.randn(576, 576, generator=gen, requires_grad=True)  # [in, out]

    def best_of(bf16: bool) -> float:
        times = []
        for _ in range(4):
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                y = a @ w  # [tokens, out]
            y.float().sum().backward()
            times.append(time.perf_counter() - start)
        return min(times[1:])

    return best_of(False) / best_of(True)


__all__ = ["BF16_PROBE_SPEEDUP", "DEVICES", "DTYPES", "cpu_bf16_speedup", "fast_bf16_matmul", "pick_device", "torch_dtype"]
