"""Shared CLI pieces: output to stdout (tables or JSON), devices and dtypes."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from ..dtypes import pick_device, torch_dtype  # noqa: F401  (pick_device: re-exported for the commands)

stdout = Console()

JsonFlag = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")]
pick_dtype = torch_dtype  # the CLI's name for it


def emit(data: dict, as_json: bool, title: str) -> None:
    """Print a flat dict as JSON or as a two-column table on stdout."""
    if as_json:
        print(json.dumps(data, indent=2, default=str, allow_nan=False))  # NaN is not JSON: never print it
        return
    table = Table(title=title, show_header=False)
    table.add_column("", style="bold")
    table.add_column("")
    for key, value in data.items():
        if isinstance(value, float):
            value = f"{value:.6g}"
        table.add_row(key, str(value))
    stdout.print(table)
