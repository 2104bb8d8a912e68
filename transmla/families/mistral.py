from .base import Family

FAMILY = Family(
    model_type="mistral",
    config_class="MistralConfig",
    causal_lm_class="MistralForCausalLM",
)
