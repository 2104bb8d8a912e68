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


__all__ = ["DEVICES", "DTYPES", "pick_device", "torch_dtype"]
