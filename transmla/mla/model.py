"""MLA models: each source family's causal LM with every attention layer swapped for MLAAttention.

A converted checkpoint keeps its source config, gets model_type "transmla_<family>" and an "mla"
block; `import transmla` registers these so AutoModelForCausalLM.from_pretrained loads them.
"""

from __future__ import annotations

import transformers
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from ..families import FAMILIES, Family
from .attention import MLAAttention
from .config import MLAConfig
from .latent_cache import LatentCache
from .packed_linear import use_packed_linears

MODEL_TYPE_PREFIX = "transmla_"


def mla_model_type(family: Family) -> str:
    return MODEL_TYPE_PREFIX + family.model_type


def _swap_attention(model) -> None:
    mla = MLAConfig.from_dict(model.config.mla)
    for i, layer in enumerate(model.model.layers):
        layer.self_attn = MLAAttention(mla, i)


def new_latent_cache(model, capacity: int) -> LatentCache:
    """A LatentCache for an MLA model, preallocated for `capacity` tokens, its sliding-window layers bounded."""
    windows = MLAConfig.from_dict(model.config.mla).sliding_windows
    return LatentCache(model.config.num_hidden_layers, capacity, windows=windows)


def _swap_in_latent_cache(model, model_kwargs: dict, max_cache_length: int) -> None:
    """generate()'s default (dynamic) cache becomes a LatentCache preallocated for
    max_cache_length tokens; a cache the caller passed, or another cache_implementation, stays."""
    key = "cache" if "cache" in model_kwargs else "past_key_values"  # the name since transformers 5.24, and before
    cache = model_kwargs.get(key)
    if type(cache) is DynamicCache and not getattr(cache, "_is_user_defined", False) and not cache.offloading:
        model_kwargs[key] = new_latent_cache(model, max_cache_length)


def _build_classes(family: Family) -> tuple[type, type]:
    base_config = getattr(transformers, family.config_class)
    base_model = getattr(transformers, family.causal_lm_class)
    config_cls = type(f"MLA{base_config.__name__}", (base_config,), {"model_type": mla_model_type(family)})

    def __init__(self, config):
        base_model.__init__(self, config)
        _swap_attention(self)
        self.post_init()

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
                                      max_cache_length):
        base_model._prepare_cache_for_generation(
            self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
        )
        _swap_in_latent_cache(self, model_kwargs, max_cache_length)
        if getattr(self, "packed_linears", None) is None:  # decode linears at memory speed on the CPU
            use_packed_linears(self)

    model_cls = type(
        f"MLA{base_model.__name__}",
        (base_model,),
        {"config_class": config_cls, "__init__": __init__, "_supports_flash_attn": False,
         "_prepare_cache_for_generation": _prepare_cache_for_generation},
    )
    return config_cls, model_cls


CONFIG_CLASSES: dict[str, type] = {}
MODEL_CLASSES: dict[str, type] = {}


def register() -> None:
    """Register every family's MLA config/model with the transformers Auto classes (idempotent)."""
    for family in FAMILIES.values():
        model_type = mla_model_type(family)
        if model_type in CONFIG_CLASSES:
            continue
        config_cls, model_cls = _build_classes(family)
        CONFIG_CLASSES[model_type], MODEL_CLASSES[model_type] = config_cls, model_cls
        AutoConfig.register(model_type, config_cls, exist_ok=True)
        AutoModelForCausalLM.register(config_cls, model_cls, exist_ok=True)
        _share_weight_conversions(family.model_type, model_type)


def _share_weight_conversions(source_type: str, model_type: str) -> None:
    """Load legacy weight names (e.g. Mixtral's per-expert w1/w2/w3) as the source family does."""
    from transformers import conversion_mapping

    mapping = conversion_mapping.get_checkpoint_conversion_mapping(source_type)
    if mapping is not None:
        conversion_mapping.register_checkpoint_conversion_mapping(model_type, mapping, overwrite=True)


def is_mla_config(config) -> bool:
    return getattr(config, "model_type", "").startswith(MODEL_TYPE_PREFIX) and getattr(config, "mla", None) is not None


def source_model_type(config) -> str:
    return config.model_type[len(MODEL_TYPE_PREFIX):] if is_mla_config(config) else config.model_type


def mla_config_for(source_config, mla: MLAConfig):
    """The converted model's config: the source config, re-typed, plus the "mla" block."""
    register()
    family_type = source_config.model_type
    data = source_config.to_dict()
    for key in ("model_type", "architectures", "quantization_config", "transformers_version", "auto_map"):
        data.pop(key, None)
    config_cls = CONFIG_CLASSES[MODEL_TYPE_PREFIX + family_type]
    config = config_cls(**data, mla=mla.to_dict())
    config.architectures = [MODEL_CLASSES[MODEL_TYPE_PREFIX + family_type].__name__]
    return config


def build_mla_model(config):
    """An MLA model (random init) for an MLA config."""
    register()
    return MODEL_CLASSES[config.model_type](config)


def set_decode_mode(model, mode: str) -> None:
    """Force "absorbed" or "expanded" attention for every layer, or "auto" (absorbed for decode)."""
    if mode not in ("auto", "absorbed", "expanded"):
        raise ValueError(f"decode mode must be auto, absorbed or expanded, got {mode!r}")
    for module in model.modules():
        if isinstance(module, MLAAttention):
            module.config.decode = mode
    if isinstance(getattr(model.config, "mla", None), dict):
        model.config.mla["decode"] = mode
