"""What every source family adapter provides: weight names as data, head geometry, RoPE.

A family is described by a `Family` record (no if-chains on model type elsewhere). The
functions below read a transformers config of any supported family.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from dataclasses import dataclass, field

import torch


class UnsupportedArchitectureError(ValueError):
    """The source model's architecture is not one transmla converts."""


def source_window(config, layer: int) -> int | None:
    """Layer `layer`'s sliding window as transformers applies it, None where every earlier token is seen:
    config.sliding_window on the layers whose layer_types entry is "sliding_attention" (Qwen2 and Qwen3
    with use_sliding_window, Gemma 3), on every layer where the config has no layer_types (Mistral,
    Mixtral: their sliding_window defaults to 4096). A window of at least max_position_embeddings never
    binds and is None (the model needs no bounded cache, and exports stay open to it)."""
    window = getattr(config, "sliding_window", None)
    if not window or window >= getattr(config, "max_position_embeddings", window + 1):
        return None
    kinds = getattr(config, "layer_types", None)
    return window if kinds is None or kinds[layer] == "sliding_attention" else None


def unwindowed_layers(config) -> tuple[int, ...]:
    """The layers without a sliding window (source_window None), or () where no layer has one."""
    layers = tuple(i for i in range(config.num_hidden_layers) if source_window(config, i) is None)
    return () if len(layers) == config.num_hidden_layers else layers


@dataclass(frozen=True)
class MoERouting:
    """How a mixture-of-experts family routes, and its MoE tensors under DeepSeek's names."""

    experts_key: str  # config attribute with the number of routed experts
    scoring_func: str  # "softmax" (over all experts) or "sigmoid"
    renormalize: bool  # the kept top-k weights are rescaled to sum to one
    # (name, tensor) of one layer's MoE tensor (prefix stripped) -> DeepSeek's names, or None if
    # the tensor is not part of the MoE.
    deepseek_tensors: Callable[[str, Any], list[tuple[str, Any]] | None]


@dataclass(frozen=True)
class Family:
    """One source model family (a transformers `model_type`)."""

    model_type: str  # e.g. "llama"
    config_class: str  # transformers class names
    causal_lm_class: str
    # Tensor names of decoder layer `i` start with layer_root (formatted with i).
    layer_root: str = "model.layers.{i}."
    attention_module: str = "self_attn"
    projections: dict[str, str] = field(
        default_factory=lambda: {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}
    )
    # Bias presence: True/False, or the name of a boolean config attribute.
    qkv_bias: bool | str = False
    o_bias: bool | str = False
    decoder_layer_class: str = ""  # in the causal LM's modeling module, e.g. "LlamaDecoderLayer"
    embed_name: str = "model.embed_tokens.weight"
    input_norm: str = "input_layernorm"  # the RMSNorm before attention, under layer_root
    # Renames one layer's stored tensors (prefix stripped) into the decoder layer's parameter
    # names, where transformers converts them on load (Mixtral's per-expert weights).
    layer_weight_adapter: Callable[[dict], dict] | None = None
    moe: MoERouting | None = None  # sparse MoE MLP (None: dense)
    # Per-head RMSNorms on queries and keys before RoPE (QK-norm): role (q_norm, k_norm) -> module
    # name under the attention module; None: no QK-norm.
    qk_norm: dict[str, str] | None = None
    # The QK-norm weight w multiplies as (offset + w), in fp32 before the cast back (Gemma: 1.0);
    # 0.0: w * x cast first (Llama-style RMSNorm, Qwen3).
    qk_norm_offset: float = 0.0
    # Raises UnsupportedArchitectureError for a config of this family that transmla cannot convert.
    check: Callable[[Any], None] | None = None
    # Per-layer attention specifics, for families whose layers differ or whose attention is not
    # Llama's (None: the Llama defaults): (config, layer) -> (inverse frequencies [d/2], cos/sin
    # scale); config -> softmax scale; config -> the factor on the embedding output. Sliding windows
    # need no hook: every family's follow transformers' own rule (source_window).
    layer_rope: Callable[[Any, int], tuple[torch.Tensor, float]] | None = None
    softmax_scale: Callable[[Any], float] | None = None
    embed_scale: Callable[[Any], float] | None = None
    notes: str = ""

    def rope(self, config, layer: int) -> tuple[torch.Tensor, float]:
        """Layer `layer`'s per-pair inverse frequencies [d/2] (fp32) and cos/sin scale."""
        return self.layer_rope(config, layer) if self.layer_rope else rope_inv_freq(config)

    def scale(self, config) -> float:
        """The source's softmax scale (1/sqrt(head_dim) unless the family says otherwise)."""
        return self.softmax_scale(config) if self.softmax_scale else attention_geometry(config).head_dim**-0.5

    def window(self, config, layer: int) -> int | None:
        """Layer `layer`'s sliding window (keys within the last `window` positions), None for all."""
        return source_window(config, layer)

    def embedding_scale(self, config) -> float:
        return self.embed_scale(config) if self.embed_scale else 1.0

    def decoder_layer(self, config, layer: int):
        """An empty (meta-free, CPU) decoder layer module of this family."""
        import importlib

        import transformers

        module = importlib.import_module(getattr(transformers, self.causal_lm_class).__module__)
        return getattr(module, self.decoder_layer_class)(config, layer)

    def layer_state_dict(self, tensors: dict) -> dict:
        return self.layer_weight_adapter(tensors) if self.layer_weight_adapter else tensors

    def _flag(self, config, flag: bool | str) -> bool:
        return bool(getattr(config, flag, False)) if isinstance(flag, str) else flag

    def has_qkv_bias(self, config) -> bool:
        return self._flag(config, self.qkv_bias)

    def has_o_bias(self, config) -> bool:
        return self._flag(config, self.o_bias)

    def attention_names(self, config, layer: int) -> dict[str, str]:
        """Map roles (q, k, v, o, and q_bias/k_bias/v_bias/o_bias where present) to tensor names."""
        prefix = self.attention_prefix(layer)
        names = {role: f"{prefix}{proj}.weight" for role, proj in self.projections.items()}
        if self.has_qkv_bias(config):
            names.update({f"{r}_bias": f"{prefix}{self.projections[r]}.bias" for r in "qkv"})
        if self.has_o_bias(config):
            names["o_bias"] = f"{prefix}{self.projections['o']}.bias"
        if self.qk_norm:
            names.update({role: f"{prefix}{module}.weight" for role, module in self.qk_norm.items()})
        return names

    def attention_prefix(self, layer: int) -> str:
        return f"{self.layer_root.format(i=layer)}{self.attention_module}."


@dataclass(frozen=True)
class AttentionGeometry:
    """Head counts and sizes: H query heads, g KV heads, d head_dim, D hidden size."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def kind(self) -> str:
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"

    @property
    def kv_elements_per_token_per_layer(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim


def attention_geometry(config) -> AttentionGeometry:
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    return AttentionGeometry(config.hidden_size, heads, kv_heads, head_dim, config.num_hidden_layers)


def rope_parameters(config) -> dict:
    params = getattr(config, "rope_parameters", None) or {}
    if "rope_theta" not in params and hasattr(config, "rope_theta"):
        params = {**params, "rope_theta": config.rope_theta}
    return params


# RoPE types whose frequencies depend on the running sequence length cannot be stored as
# fixed per-pair frequencies.
_DYNAMIC_ROPE = {"dynamic", "longrope"}


def rope_inv_freq(config, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Per-pair inverse frequencies [d/2] (fp32) and the cos/sin scale, as transformers computes them.

    Pair i is dims (i, i + d/2) of a head (rotate-half layout). layer_type: for configs whose
    rope_parameters hold one entry per layer type (Gemma 3: sliding_attention, full_attention).
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = rope_parameters(config)
    if layer_type is not None:
        params = params[layer_type]
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in _DYNAMIC_ROPE:
        raise UnsupportedArchitectureError(
            f"rope type {rope_type!r} changes with sequence length and is not supported; "
            f"supported: default, linear, llama3, yarn"
        )
    if rope_type == "default":
        # Same formula as LlamaRotaryEmbedding.compute_default_rope_parameters.
        dim = attention_geometry(config).head_dim
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq.float(), 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise UnsupportedArchitectureError(f"unknown rope type {rope_type!r}")
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **kwargs)
    return inv_freq.float(), float(scaling)
