from .base import Family, UnsupportedArchitectureError


def refuse_sliding_layers(config) -> None:
    """Qwen3 may run some layers with a sliding window (use_sliding_window); the qwen3 family maps no
    layer windows into the MLA config yet (gemma3's does), so such a model would attend further than
    its source."""
    sliding = [i for i, kind in enumerate(getattr(config, "layer_types", None) or []) if kind == "sliding_attention"]
    if sliding:
        raise UnsupportedArchitectureError(
            f"qwen3 with sliding-window layers ({len(sliding)} of them, from layer {sliding[0]}) is not supported: "
            "the qwen3 family does not carry layer windows into the conversion yet"
        )


# Qwen3: q_norm/k_norm (RMSNorm over head_dim, per head, before RoPE); q/k/v/o biases only with
# attention_bias; head_dim need not be hidden_size / heads.
FAMILY = Family(
    model_type="qwen3",
    config_class="Qwen3Config",
    decoder_layer_class="Qwen3DecoderLayer",
    causal_lm_class="Qwen3ForCausalLM",
    qkv_bias="attention_bias",
    o_bias="attention_bias",
    qk_norm={"q_norm": "q_norm", "k_norm": "k_norm"},
    check=refuse_sliding_layers,
    notes="QK-norm: the key norm is computed when the cache row is written",
)
