from .base import Family

# Qwen2 always has q/k/v biases and never an o_proj bias.
FAMILY = Family(
    model_type="qwen2",
    config_class="Qwen2Config",
    decoder_layer_class="Qwen2DecoderLayer",
    causal_lm_class="Qwen2ForCausalLM",
    qkv_bias=True,
    o_bias=False,
)
