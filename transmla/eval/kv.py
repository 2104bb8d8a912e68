"""KV-cache accounting: elements and bytes per token from a config (per layer and per model), and what a
transformers Cache really holds, to set beside the formula."""

from __future__ import annotations

import torch

from ..families import AttentionGeometry, attention_geometry
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


def kv_summary(config, dtype: torch.dtype | None = None, context: int | None = None) -> dict:
    """What one token costs in the KV cache, for a source (MHA/GQA) or converted (MLA) config."""
    dtype = dtype or config_dtype(config)
    nbytes = DTYPE_BYTES.get(dtype, torch.tensor([], dtype=dtype).element_size())
    geo = _geometry(config)
    info = {
        "architecture": source_model_type(config),
        "layers": geo.num_layers,
        "heads": geo.num_heads,
        "hidden_size": geo.hidden_size,
        "cache_dtype": str(dtype).removeprefix("torch."),
    }
    if getattr(config, "model_type", "") in DEEPSEEK_TYPES:  # an exported model: latent + shared rope key
        elements = config.kv_lora_rank + config.qk_rope_head_dim
        info.update(
            attention="MLA", kv_heads=1, kv_lora_rank=config.kv_lora_rank, qk_rope_head_dim=config.qk_rope_head_dim,
            qk_nope_head_dim=config.qk_nope_head_dim, v_head_dim=config.v_head_dim, q_lora_rank=config.q_lora_rank,
        )
    elif is_mla_config(config):
        mla = MLAConfig.from_dict(config.mla)
        src = mla.source
        elements = mla.kv_elements_per_token_per_layer
        info.update(
            attention="MLA",
            kv_heads=1,
            kv_lora_rank=mla.kv_lora_rank,
            qk_rope_head_dim=mla.qk_rope_head_dim,
            qk_nope_head_dim=mla.qk_nope_head_dim,
            v_head_dim=mla.v_head_dim,
            q_lora_rank=mla.q_lora_rank,
            method=mla.method.get("name"),
            source_kv_heads=src.get("num_key_value_heads"),
            source_head_dim=src.get("head_dim"),
            source_kv_elements_per_token_per_layer=src.get("kv_elements_per_token_per_layer"),
        )
        if src.get("kv_elements_per_token_per_layer"):
            info["source_kv_bytes_per_token"] = src["kv_elements_per_token_per_layer"] * geo.num_layers * nbytes
            info["cache_ratio"] = elements / src["kv_elements_per_token_per_layer"]
    else:
        elements = geo.kv_elements_per_token_per_layer
        info.update(attention=geo.kind, kv_heads=geo.num_kv_heads, head_dim=geo.head_dim)
    info.update(
        kv_elements_per_token_per_layer=elements,
        kv_bytes_per_token_per_layer=elements * nbytes,
        kv_bytes_per_token=elements * nbytes * geo.num_layers,
    )
    if context:
        info["context"] = context
        info["kv_bytes_at_context"] = info["kv_bytes_per_token"] * context
    return info


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
