from .base import Family

FAMILY = Family(
    model_type="mistral",
    config_class="MistralConfig",
    decoder_layer_class="MistralDecoderLayer",
    causal_lm_class="MistralForCausalLM",
)
