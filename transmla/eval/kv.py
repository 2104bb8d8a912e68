"""KV-cache accounting: elements and bytes per token from a config (per layer and per model), and what a
transformers Cache really holds, to set beside the formula."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..families import FAMILIES, AttentionGeometry, attention_geometry
from ..mla.config import MLAConfig
from ..mla.model import is_mla_config, source_model_type

DEEPSEEK_TYPES = ("deepseek_v2", "deepseek_v3")
DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


def config_dtype(config) -> torch.dtype:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."))
    return dtype


def _geometry(config):
    if getattr(config, "model_type", "") in DEEPSEEK_TYPES:  # its head_dim is the rope key's
        heads = config.num_attention_heads
        return AttentionGeometry(config.hidden_size, heads, heads, config.qk_nope_head_dim + config.qk_rope_head_dim,
                                 config.num_hidden_layers)
    return attention_geometry(config)


@dataclass
class LatentShape:
    """The latent of an MLA model (converted, or exported to DeepSeek-V3)."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None


@dataclass
class ConvertedFrom:
    """What a converted model's config records of its conversion (mla.method, mla.source)."""

    method: str | None
    kv_heads: int | None
    head_dim: int | None
    kv_elements_per_token_per_layer: int | None


@dataclass
class KVSummary:
    """What one token costs in the KV cache; a dict (``to_dict``) only when written."""

    architecture: str
    layers: int
    heads: int
    hidden_size: int
    cache_dtype: str
    element_bytes: int
    attention: str  # "MLA" | "GQA" | "MHA"
    kv_heads: int
    kv_elements_per_token_per_layer: int
    head_dim: int | None = None  # a source's (MHA/GQA)
    latent: LatentShape | None = None  # an MLA model's
    converted_from: ConvertedFrom | None = None  # a converted (native MLA) model's
    context: int | None = None
    # QK-norm (Qwen3): the source normalises query and key heads before RoPE; a converted model's
    # cache write applies the key norm (only listed when True)
    qk_norm: bool = False

    @property
    def method(self) -> str | None:
        return self.converted_from.method if self.converted_from else None

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        return self.kv_elements_per_token_per_layer * self.element_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_bytes_per_token_per_layer * self.layers

    @property
    def kv_bytes_at_context(self) -> int | None:
        return self.kv_bytes_per_token * self.context if self.context else None

    def to_dict(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "architecture": self.architecture,
            "layers": self.layers,
            "heads": self.heads,
            "hidden_size": self.hidden_size,
            "cache_dtype": self.cache_dtype,
            "attention": self.attention,
            "kv_heads": self.kv_heads,
        }
        if self.latent is None:
            info["head_dim"] = self.head_dim
        else:
            info.update(asdict(self.latent))
        if self.qk_norm:
            info["qk_norm"] = "per-head q/k RMSNorm before RoPE" + (
                "; the key norm is applied when a cache row is written" if self.latent is not None else "")
        src = self.converted_from
        if src is not None:
            info.update(
                method=src.method,
                source_kv_heads=src.kv_heads,
                source_head_dim=src.head_dim,
                source_kv_elements_per_token_per_layer=src.kv_elements_per_token_per_layer,
            )
            if src.kv_elements_per_token_per_layer:
                info["source_kv_bytes_per_token"] = src.kv_elements_per_token_per_layer * self.layers * self.element_bytes
                info["cache_ratio"] = self.kv_elements_per_token_per_layer / src.kv_elements_per_token_per_layer
        info.update(
            kv_elements_per_token_per_layer=self.kv_elements_per_token_per_layer,
            kv_bytes_per_token_per_layer=self.kv_bytes_per_token_per_layer,
            kv_bytes_per_token=self.kv_bytes_per_token,
        )
        if self.context:
            info["context"] = self.context
            info["kv_bytes_at_context"] = self.kv_bytes_at_context
        return info


def kv_summary(config, dtype: torch.dtype | None = None, context: int | None = None) -> KVSummary:
    """What one token costs in the KV cache, for a source (MHA/GQA) or converted (MLA) config."""
    dtype = dtype or config_dtype(config)
    nbytes = DTYPE_BYTES.get(dtype, torch.tensor([], dtype=dtype).element_size())
    geo = _geometry(config)
    common = dict(architecture=source_model_type(config), layers=geo.num_layers, heads=geo.num_heads,
                  hidden_size=geo.hidden_size, cache_dtype=str(dtype).removeprefix("torch."), element_bytes=nbytes,
                  context=context)
    if getattr(config, "model_type", "") in DEEPSEEK_TYPES:  # an exported model: latent + shared rope key
        latent = LatentShape(config.kv_lora_rank, config.qk_rope_head_dim, config.qk_nope_head_dim,
                             config.v_head_dim, config.q_lora_rank)
        return KVSummary(**common, attention="MLA", kv_heads=1,
                         kv_elements_per_token_per_layer=config.kv_lora_rank + config.qk_rope_head_dim, latent=latent)
    if is_mla_config(config):
        mla = MLAConfig.from_dict(config.mla)
        src = mla.source
        latent = LatentShape(mla.kv_lora_rank, mla.qk_rope_head_dim, mla.qk_nope_head_dim, mla.v_head_dim,
                             mla.q_lora_rank)
        converted = ConvertedFrom(mla.method.get("name"), src.get("num_key_value_heads"), src.get("head_dim"),
                                  src.get("kv_elements_per_token_per_layer"))
        return KVSummary(**common, attention="MLA", kv_heads=1,
                         kv_elements_per_token_per_layer=mla.kv_elements_per_token_per_layer, latent=latent,
                         converted_from=converted, qk_norm=mla.qk_norm)
    family = FAMILIES.get(getattr(config, "model_type", ""))
    return KVSummary(**common, attention=geo.kind, kv_heads=geo.num_kv_heads,
                     kv_elements_per_token_per_layer=geo.kv_elements_per_token_per_layer, head_dim=geo.head_dim,
                     qk_norm=bool(family and family.qk_norm))


def _cache_tensors(cache):
    """Every key and value tensor a transformers Cache holds, all layers."""
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if t is not None:
                yield t


def cache_elements(cache) -> int:
    """Elements held by a transformers Cache (all layers, keys and values)."""
    return sum(t.numel() for t in _cache_tensors(cache))


def cache_bytes(cache) -> int:
    """Bytes held by a transformers Cache (all layers, keys and values)."""
    return sum(t.numel() * t.element_size() for t in _cache_tensors(cache))
