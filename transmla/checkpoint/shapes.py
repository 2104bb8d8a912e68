"""Why a checkpoint's weights do not fit its config.json: the first tensor whose shape differs,
both shapes, and the config fields that set the expected one (a folder edited by hand, say)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..mla.config import MLAConfig
from .reader import SafetensorsReader


def shape_mismatches(path: Path, config) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """(tensor, shape in the weights, shape config.json gives) for every tensor that differs."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # shapes only, no memory
        model = AutoModelForCausalLM.from_config(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    with SafetensorsReader(path) as reader:
        return [(name, tuple(reader.shape_of(name)), expected[name]) for name in reader.keys()
                if name in expected and tuple(reader.shape_of(name)) != expected[name]]


def _fields_behind(name: str, want: tuple[int, ...], config) -> str:
    mla = getattr(config, "mla", None)
    if isinstance(mla, dict):
        fields = next((MLAConfig.from_dict(mla).fields_of(part) for part in name.split(".")
                       if MLAConfig.from_dict(mla).fields_of(part)), {})
        if fields:
            return ", ".join(f"mla.{k} = {v}" for k, v in fields.items())
    # Elsewhere: the top-level integer fields equal to one of the expected dimensions.
    found = {k: v for k, v in config.to_dict().items() if isinstance(v, int) and not isinstance(v, bool) and v in want}
    return ", ".join(f"{k} = {v}" for k, v in found.items()) or "no single field"


def describe_shape_mismatch(path: Path, config) -> str:
    """One line naming the first mismatched tensor, both shapes and the config fields behind it."""
    bad = shape_mismatches(path, config)
    if not bad:
        return f"{path}: transformers refused the weights for a size mismatch, but every tensor's shape matches config.json"
    name, got, want = bad[0]
    more = f" ({len(bad) - 1} more tensors differ)" if len(bad) > 1 else ""
    return (f"{path}: weights and config.json disagree: {name} is {list(got)} in the weights but "
            f"{list(want)} from config.json ({_fields_behind(name, want, config)}){more}")


__all__ = ["describe_shape_mismatch", "shape_mismatches"]
