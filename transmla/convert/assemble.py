"""Converted layers into a model: the MLAConfig they make, and an in-memory MLA model (no files)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from ..checkpoint.reader import SafetensorsReader
from ..families import UnsupportedArchitectureError, attention_geometry, family_for
from ..mla.config import MLAConfig
from ..mla.model import build_mla_model, mla_config_for
from .layers import MLALayer


def mla_config(config, first: MLALayer, inv_freqs: list[list[float]], method: dict,
               source_layers: list[int] | None = None) -> MLAConfig:
    """The MLAConfig of a model whose layers have `first`'s shapes and these per-layer rope frequencies;
    source_layers: the source layer of each (default: 0, 1, ...), whose window and rope scale they keep."""
    geo = attention_geometry(config)
    family = family_for(config)
    source_layers = list(range(len(inv_freqs))) if source_layers is None else source_layers
    scalings = {family.rope(config, i)[1] for i in source_layers}
    if len(scalings) > 1:
        raise UnsupportedArchitectureError(f"layers with different rope attention scalings {sorted(scalings)} are not supported")
    windows = [family.window(config, i) or 0 for i in source_layers]
    d_r = 2 * first.rope_inv_freq.numel()
    d_c = first.kv_a_proj.shape[0] - d_r
    H = geo.num_heads
    q_out = (first.q_b_proj if first.q_a_proj is not None else first.q_proj).shape[0]
    return MLAConfig(
        num_heads=H,
        hidden_size=geo.hidden_size,
        kv_lora_rank=d_c,
        qk_rope_head_dim=d_r,
        qk_nope_head_dim=q_out // H - d_r,
        v_head_dim=first.o_proj.shape[1] // H,
        softmax_scale=family.scale(config),  # the source's scale, kept exactly
        rope_inv_freq=inv_freqs,
        rope_attention_scaling=scalings.pop(),
        q_lora_rank=None if first.q_a_proj is None else first.q_a_proj.shape[0],
        kv_a_norm=first.kv_a_norm is not None,
        q_bias=first.q_bias is not None,
        kv_a_bias=first.kv_a_bias is not None,
        kv_b_bias=first.kv_b_bias is not None,
        o_bias=first.o_bias is not None,
        rms_norm_eps=getattr(config, "rms_norm_eps", 1e-6),
        qk_norm_kv_heads=0 if first.k_norm is None else geo.num_kv_heads,
        qk_norm_head_dim=0 if first.k_norm is None else geo.head_dim,
        qk_norm_bias=first.k_pre_bias is not None,
        qk_norm_offset=0.0 if first.k_norm is None else family.qk_norm_offset,
        sliding_windows=windows if any(windows) else [],
        source={
            "model_type": config.model_type,
            "num_key_value_heads": geo.num_kv_heads,
            "head_dim": geo.head_dim,
            "kv_elements_per_token_per_layer": geo.kv_elements_per_token_per_layer,
        },
        method=method,
    )


def assemble_model(source_dir: Path, config, layers: Sequence[MLALayer], method: dict | None = None, dtype=torch.float32):
    """An in-memory MLA model from converted layers plus the source's other weights (no files)."""
    family = family_for(config)
    mla = mla_config(config, layers[0], [layer.rope_inv_freq.tolist() for layer in layers], method or {})
    model = build_mla_model(mla_config_for(config, mla))
    geo = attention_geometry(config)
    state: dict[str, torch.Tensor] = {}
    with SafetensorsReader(source_dir) as reader:
        keys = reader.keys()
        for i in range(geo.num_layers):
            root, attn = family.layer_root.format(i=i), family.attention_prefix(i)
            own = {k[len(root):]: reader.get(k) for k in keys if k.startswith(root) and not k.startswith(attn)}
            state.update({root + k: v for k, v in family.layer_state_dict(own).items()})
            state.update(layers[i].state_dict(attn))
        state.update({k: reader.get(k) for k in keys if not k.startswith(family.layer_root.split("{")[0])})
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not config.tie_word_embeddings]
    if missing or unexpected:
        raise ValueError(f"assembling the MLA model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.to(dtype).eval()
