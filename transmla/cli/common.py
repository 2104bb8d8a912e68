"""Shared CLI pieces: output to stdout (tables or JSON), devices and dtypes."""

from __future__ import annotations

import json
from typing import Annotated

import torch
import typer
from rich.console import Console
from rich.table import Table

stdout = Console()

JsonFlag = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")]
DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def pick_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for, but no CUDA GPU is available")
    return device


def pick_dtype(name: str) -> torch.dtype:
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {name!r}")
    return DTYPE_NAMES[name]


def emit(data: dict, as_json: bool, title: str) -> None:
    """Print a flat dict as JSON or as a two-column table on stdout."""
    if as_json:
        print(json.dumps(data, indent=2, default=str))
        return
    table = Table(title=title, show_header=False)
    table.add_column("", style="bold")
    table.add_column("")
    for key, value in data.items():
        if isinstance(value, float):
            value = f"{value:.6g}"
        table.add_row(key, str(value))
    stdout.print(table)
