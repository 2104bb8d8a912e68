from .base import Family

FAMILY = Family(
    model_type="llama",
    config_class="LlamaConfig",
    decoder_layer_class="LlamaDecoderLayer",
    causal_lm_class="LlamaForCausalLM",
    qkv_bias="attention_bias",
    o_bias="attention_bias",
)
