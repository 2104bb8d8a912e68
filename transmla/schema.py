"""Settings dataclasses whose fields carry their own help: the CLI (cli/options.py) derives its
flags from them, so a setting is declared once."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def option(default: Any, help: str, short: str | None = None, flag: str | None = None) -> Any:
    """A dataclass field with its help text (and optional short flag / flag name) for the CLI."""
    meta = {"help": help}
    if short:
        meta["short"] = short
    if flag:
        meta["flag"] = flag
    return field(default=default, metadata=meta)


__all__ = ["option"]
