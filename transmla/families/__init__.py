"""Source model families. Everything model-specific lives here."""

from . import gemma3, llama, mistral, mixtral, qwen2, qwen3
from .base import (
    AttentionGeometry,
    Family,
    UnsupportedArchitectureError,
    attention_geometry,
    rope_inv_freq,
    unwindowed_layers,
)

FAMILIES: dict[str, Family] = {m.FAMILY.model_type: m.FAMILY for m in (llama, qwen2, qwen3, mistral, mixtral, gemma3)}


def family_for(config_or_type) -> Family:
    """The family adapter for a transformers config (or model_type string)."""
    model_type = config_or_type if isinstance(config_or_type, str) else getattr(config_or_type, "model_type", None)
    if model_type in FAMILIES:
        family = FAMILIES[model_type]
        if family.check is not None and not isinstance(config_or_type, str):
            family.check(config_or_type)
        return family
    raise UnsupportedArchitectureError(
        f"unsupported architecture {model_type!r}; supported: {', '.join(sorted(FAMILIES))}"
    )


__all__ = [
    "FAMILIES",
    "AttentionGeometry",
    "Family",
    "UnsupportedArchitectureError",
    "attention_geometry",
    "family_for",
    "rope_inv_freq",
    "unwindowed_layers",
]
