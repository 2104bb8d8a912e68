"""The conversion methods by name. Adding one: a folder with its ConversionMethod, and a line here."""

from __future__ import annotations

from dataclasses import fields

from .lossless.method import Lossless
from .method import ConversionMethod
from .mha2mla.method import MHA2MLA
from .transmla.method import TransMLA

METHODS: dict[str, ConversionMethod] = {m.name: m for m in (Lossless(), TransMLA(), MHA2MLA())}


def get_method(name: str) -> ConversionMethod:
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(sorted(METHODS))}")
    return METHODS[name]


def budget_methods() -> list[str]:
    """The methods that shrink the cache to a budget (their Options take kv_budget), by name."""
    return [name for name, m in METHODS.items() if "kv_budget" in {f.name for f in fields(m.Options)}]


__all__ = ["METHODS", "budget_methods", "get_method"]
