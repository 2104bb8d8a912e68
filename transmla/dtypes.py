"""Names users give for dtypes and devices, turned into torch objects in one place."""

from __future__ import annotations

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
    """Whether bf16 matrix products pay on `device`: a CUDA GPU with bf16, or a CPU with AMX tiles.
    AVX-512 BF16 alone does not count: it has bf16 dot products, but oneDNN's bf16 training passes
    (the output fit's) ran slower than fp32 there (benchmarks/results/fit_cost.md)."""
    if device.startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


__all__ = ["DEVICES", "DTYPES", "fast_bf16_matmul", "pick_device", "torch_dtype"]
