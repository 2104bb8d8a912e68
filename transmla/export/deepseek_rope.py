"""The DeepSeek export's rope (rule 3 of export/deepseek.py) and softmax scale (rule 2): the one
frequency grid every layer must share, read back through stock DeepseekV3's own rotary embedding,
and the scale every engine computes for it."""

from __future__ import annotations

import math

import torch

from ..mla.config import MLAConfig
from .errors import ExportError


def source_rope_parameters(cfg: dict) -> dict:
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if "rope_theta" not in params and "rope_theta" in cfg:
        params["rope_theta"] = cfg["rope_theta"]
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def _deepseek_rope(rope_parameters: dict, d_r: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [d_r/2] and cos/sin scale that stock DeepseekV3 computes for these settings."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    config = DeepseekV3Config(
        hidden_size=64, num_attention_heads=1, qk_rope_head_dim=d_r, max_position_embeddings=max_positions,
        rope_parameters=dict(rope_parameters),
    )
    rotary = DeepseekV3RotaryEmbedding(config)
    return rotary.inv_freq.float(), float(rotary.attention_scaling)


def shared_rope_grid(mla: MLAConfig, source_rope: dict, max_positions: int) -> tuple[dict, list[int]]:
    """The DeepSeek rope_parameters and pair order that reproduce every layer's rope key exactly.

    The kept frequencies must be the same in every layer and, sorted descending, equal the grid
    DeepseekV3 computes: theta'^(-2i/d_r) (then the source's scaling, e.g. llama3), with theta'
    fitted from the second frequency (the grid starts at 1).
    """
    freqs = torch.tensor(mla.rope_inv_freq, dtype=torch.float64)  # [L, d_r/2]
    d_r = mla.qk_rope_head_dim
    hint = ("convert with TransMLA's default --shared-rope (not --per-layer-rope) or with --format deepseek, which "
            "keep one grid in every layer")
    if d_r == 0:
        raise ExportError("the model has no rope key (qk_rope_head_dim 0); DeepSeek needs at least one rope pair")
    if not torch.allclose(freqs, freqs[:1].expand_as(freqs), rtol=1e-6, atol=0):
        raise ExportError(f"rope frequencies differ between layers; DeepSeek shares one rope in all layers: {hint}")
    layer = freqs[0]
    order = torch.argsort(layer, descending=True, stable=True)
    ranked = layer[order]
    params = {k: v for k, v in source_rope.items() if k != "rope_theta"}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        # theta'^(-2/d_r) = w_1 / w_0 with w_0 = 1: the grid's ratio fixes theta'.
        source_theta = float(source_rope.get("rope_theta", 10000.0))
        theta = source_theta if ranked.numel() < 2 else float((ranked[0] / ranked[1]) ** (d_r / 2))
        if math.isclose(theta, source_theta, rel_tol=1e-4):  # FreqFold's grid: the source's own theta
            theta = source_theta
    else:  # scaled ropes (llama3, linear, yarn): the grid must be the source theta's
        theta = float(source_rope["rope_theta"])
    params["rope_theta"] = theta
    grid, scaling = _deepseek_rope(params, d_r, max_positions)
    if not torch.allclose(ranked.float(), grid, rtol=2e-6, atol=0):
        raise ExportError(
            f"the rope frequencies are not one grid theta^(-2i/{d_r}) ({rope_type} rope); "
            f"DeepSeek cannot represent them: {hint}"
        )
    if not math.isclose(scaling, float(mla.rope_attention_scaling), rel_tol=1e-6):
        raise ExportError(
            f"the {rope_type} rope's attention scaling {mla.rope_attention_scaling} differs from the "
            f"{scaling} DeepSeek computes for {d_r} rope dims; not representable"
        )
    return params, order.tolist()


def deepseek_softmax_scale(rope_parameters: dict, qk_head_dim: int) -> float:
    """DeepSeek's scale: qk_head_dim^-1/2, times mscale^2 for yarn with mscale_all_dim (as every engine)."""
    scale = qk_head_dim**-0.5
    factor, mscale_all_dim = rope_parameters.get("factor", 1.0), rope_parameters.get("mscale_all_dim", 0)
    if rope_parameters.get("rope_type", "default") != "default" and mscale_all_dim and factor > 1:
        m = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= m * m
    return scale


__all__ = ["deepseek_softmax_scale", "shared_rope_grid", "source_rope_parameters"]
