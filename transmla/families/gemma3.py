"""Gemma 3, text part (transformers' Gemma3TextConfig / Gemma3ForCausalLM).

What differs from Llama, and where it goes: QK-norm whose RMSNorm multiplies by (1 + w) in fp32
(qk_norm_offset; the MLA layer's pre-maps keep w as stored); softmax scale
1/sqrt(query_pre_attn_scalar), not 1/sqrt(head_dim); sliding-window layers (layer_types,
sliding_window) beside global ones, each kind with its own RoPE parameters (rope_local_base_freq
for local layers, rope_theta for global ones); embeddings times sqrt(hidden_size). The extra norms
around attention and MLP, the GELU-tanh MLP, the embedding scale at run time and the tied
embeddings belong to the source's own decoder layer and causal LM, which the MLA model keeps.
"""

from __future__ import annotations

from .base import Family, UnsupportedArchitectureError, rope_inv_freq

_KINDS = ("sliding_attention", "full_attention")


def check(config) -> None:
    """Refuse what an MLA layer does not compute: logit soft-capping in attention, bidirectional
    attention, layer kinds other than sliding and full."""
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise UnsupportedArchitectureError("gemma3 with attn_logit_softcapping is not supported: MLA attention does not soft-cap")
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedArchitectureError("gemma3 with use_bidirectional_attention is not supported: MLA attention is causal")
    odd = sorted(set(config.layer_types) - set(_KINDS))
    if odd:
        raise UnsupportedArchitectureError(f"gemma3 layer type {odd[0]!r} is not supported; supported: {', '.join(_KINDS)}")


def layer_rope(config, layer: int):
    return rope_inv_freq(config, config.layer_types[layer])


FAMILY = Family(
    model_type="gemma3_text",
    config_class="Gemma3TextConfig",
    decoder_layer_class="Gemma3DecoderLayer",
    causal_lm_class="Gemma3ForCausalLM",
    qkv_bias="attention_bias",
    o_bias="attention_bias",
    qk_norm={"q_norm": "q_norm", "k_norm": "k_norm"},
    qk_norm_offset=1.0,
    check=check,
    layer_rope=layer_rope,
    softmax_scale=lambda config: config.query_pre_attn_scalar**-0.5,
    embed_scale=lambda config: config.hidden_size**0.5,
    notes="QK-norm (1 + w), query_pre_attn_scalar, sliding-window layers: each masked to its window, "
          "its latent cache bounded to 2x the window",
)
