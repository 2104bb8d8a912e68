"""Measured KV cache: generate N tokens and count the bytes the cache really holds.

The formula (``kv.kv_summary``) says what one token costs: ``d_c + d_r`` elements per layer for
an MLA model (the latent and the shared rope key), ``2 * n_kv * head_dim`` for a GQA/MHA source.
Here we prefill a prompt, decode N tokens greedily one at a time through the model's own cache
(a transformers ``DynamicCache``; for MLA its keys are the latent [B, 1, S, d_c] and its values
the rope key [B, 1, S, d_r]) and count every element that cache holds, layer by layer. The
measurement must equal ``elements per token per layer * layers * cached tokens * bytes``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..mla.latent_cache import cache_kwargs
from .kv import cache_bytes, cache_elements, kv_summary

__all__ = ["MeasuredCache", "measure_cache"]


@dataclass
class MeasuredCache:
    """What the cache held after ``prompt_tokens`` + ``new_tokens`` tokens went through it."""

    attention: str  # "MLA" | "GQA" | "MHA"
    prompt_tokens: int
    new_tokens: int
    cached_tokens: int  # tokens the cache holds (prompt + generated)
    layers: int
    cache_dtype: str
    measured_elements: int
    measured_bytes: int
    formula_elements: int  # kv_elements_per_token_per_layer * layers * cached_tokens
    formula_bytes: int
    measured_bytes_per_token_per_layer: float
    formula_bytes_per_token_per_layer: int
    decode: str | None  # MLA decode path used ("absorbed" / "expanded" / "auto"), None for a source

    @property
    def matches(self) -> bool:
        return self.measured_bytes == self.formula_bytes and self.measured_elements == self.formula_elements

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "matches_formula": self.matches}


def _device(model: torch.nn.Module) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:  # pragma: no cover
        return torch.device("cpu")


def measure_cache(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    new_tokens: int = 64,
    decode: str | None = "absorbed",
) -> MeasuredCache:
    """Prefill ``prompt_ids`` [T] (or [1, T]), decode ``new_tokens`` greedily, measure the cache.

    ``decode`` sets the MLA decode path (ignored for source models); the model's own setting is
    restored afterwards. Every generated token is fed back, so the cache ends up holding
    ``T + new_tokens`` tokens.
    """
    from transformers import DynamicCache

    from ..mla.model import is_mla_config, set_decode_mode

    if new_tokens < 1:
        raise ValueError(f"new_tokens must be at least 1, got {new_tokens}")
    ids = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(1, -1).to(_device(model))  # [1, T]
    if ids.shape[1] < 1:
        raise ValueError("the prompt needs at least one token")
    mla = is_mla_config(model.config)
    old_mode = model.config.mla.get("decode", "auto") if mla else None
    if mla and decode is not None:
        set_decode_mode(model, decode)
    was_training = model.training
    model.eval()
    try:
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            out = model(input_ids=ids, **cache_kwargs(cache), use_cache=True)  # prefill: T tokens cached
            for _ in range(new_tokens):
                nxt = out.logits[:, -1:].argmax(-1)  # [1, 1] greedy
                out = model(input_ids=nxt, **cache_kwargs(cache), use_cache=True)
        cached = int(cache.get_seq_length())  # the cache passed in, filled in place
        dtype = next(model.parameters()).dtype
    finally:
        if mla and decode is not None:
            set_decode_mode(model, old_mode)
        model.train(was_training)
    kv = kv_summary(model.config, dtype)
    per_token_layer = kv.kv_elements_per_token_per_layer
    layers = kv.layers
    measured_bytes = cache_bytes(cache)
    return MeasuredCache(
        attention=kv.attention,
        prompt_tokens=int(ids.shape[1]),
        new_tokens=new_tokens,
        cached_tokens=cached,
        layers=layers,
        cache_dtype=kv.cache_dtype,
        measured_elements=cache_elements(cache),
        measured_bytes=measured_bytes,
        formula_elements=per_token_layer * layers * cached,
        formula_bytes=kv.kv_bytes_per_token_per_layer * layers * cached,
        measured_bytes_per_token_per_layer=measured_bytes / (layers * cached) if cached else 0.0,
        formula_bytes_per_token_per_layer=kv.kv_bytes_per_token_per_layer,
        decode=(decode or old_mode) if mla else None,
    )
