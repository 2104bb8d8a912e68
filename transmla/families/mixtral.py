from .base import Family

# The sparse MoE MLP is copied through untouched; only attention changes.
FAMILY = Family(
    model_type="mixtral",
    config_class="MixtralConfig",
    causal_lm_class="MixtralForCausalLM",
    notes="MoE MLP untouched",
)
