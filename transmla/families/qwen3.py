from .base import Family

# Qwen3: q_norm/k_norm (RMSNorm over head_dim, per head, before RoPE); q/k/v/o biases only with
# attention_bias; head_dim need not be hidden_size / heads; sliding-window layers (use_sliding_window,
# from max_window_layers on) keep their window (base.source_window).
FAMILY = Family(
    model_type="qwen3",
    config_class="Qwen3Config",
    decoder_layer_class="Qwen3DecoderLayer",
    causal_lm_class="Qwen3ForCausalLM",
    qkv_bias="attention_bias",
    o_bias="attention_bias",
    qk_norm={"q_norm": "q_norm", "k_norm": "k_norm"},
    notes="QK-norm: the key norm is computed when the cache row is written",
)
