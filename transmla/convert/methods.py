"""The conversion methods by name. Each turns (source folder, config, options) into the
converted layers (an iterator, one layer at a time) and a description of what it did."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

from .layers import MLALayer
from .options import ConvertOptions
from .pipeline import source_layers
from .replicate import replicate

MethodFn = Callable[[Path, object, ConvertOptions, bool], tuple[Iterator[MLALayer], dict]]


def lossless(source_dir: Path, config, options: ConvertOptions, progress: bool = True):
    """Key/value replication: exact, no cache saving (ALGORITHMS.md, lossless)."""
    return (replicate(src) for src in source_layers(source_dir, config)), {"name": "lossless"}


def transmla(source_dir: Path, config, options: ConvertOptions, progress: bool = True):
    """TransMLA: RoRoPE, FreqFold, BKV-PCA (ALGORITHMS.md)."""
    from .transmla_method import transmla_layers

    return transmla_layers(source_dir, config, options, progress)


def mha2mla(source_dir: Path, config, options: ConvertOptions, progress: bool = True):
    """MHA2MLA: partial-RoPE selection and (activation-aware) SVD (ALGORITHMS.md)."""
    from .mha2mla_method import mha2mla_layers

    return mha2mla_layers(source_dir, config, options, progress)


METHODS: dict[str, MethodFn] = {"lossless": lossless, "transmla": transmla, "mha2mla": mha2mla}


def get_method(name: str) -> MethodFn:
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(sorted(METHODS))}")
    return METHODS[name]
