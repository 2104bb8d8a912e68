"""MLAConfig: the "mla" block of a converted checkpoint's config.json.

Notation (ALGORITHMS.md): H heads, d_c = kv_lora_rank (latent), d_r = qk_rope_head_dim (the one
shared rope key), d_nope = qk_nope_head_dim, d_v = v_head_dim, d_q = q_lora_rank.
Cache per token per layer: d_c + d_r elements.
QK-norm sources (qk_norm, ALGORITHMS.md "QK-norm"): g = qk_norm_kv_heads source KV heads of d_s =
qk_norm_head_dim dims. The query side reads q~ = q_norm(q_pre_proj x) per head [H*d_s] instead of x;
the cache write computes the source's normed keys k~ = k_norm(k_pre_proj x) per KV head [g*d_s] and
kv_a_proj reads [k~ | x]. With qk_norm_offset the norms multiply by (offset + w) in fp32 before the
cast back (Gemma's RMSNorm: offset 1) instead of w * x cast first (Qwen3's).
Sliding windows (sliding_windows[layer] = w > 0): a query at position t attends to the cached tokens
t - w < s <= t only, in every path (mla/window.py); 0 = every cached token.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


# Attention projection (attribute name) -> the MLAConfig fields its weight's shape comes from.
_QK = ("qk_norm_kv_heads", "qk_norm_head_dim")
SHAPE_FIELDS = {
    "q_proj": ("num_heads", "qk_nope_head_dim", "qk_rope_head_dim", "hidden_size", *_QK),
    "q_a_proj": ("q_lora_rank", "hidden_size", *_QK),
    "q_b_proj": ("num_heads", "qk_nope_head_dim", "qk_rope_head_dim", "q_lora_rank"),
    "kv_a_proj": ("kv_lora_rank", "qk_rope_head_dim", "hidden_size", *_QK),
    "q_pre_proj": ("num_heads", "qk_norm_head_dim", "hidden_size"),
    "k_pre_proj": ("qk_norm_kv_heads", "qk_norm_head_dim", "hidden_size"),
    "q_norm": ("qk_norm_head_dim",),
    "k_norm": ("qk_norm_head_dim",),
    "kv_a_norm": ("kv_lora_rank",),
    "kv_b_proj": ("num_heads", "qk_nope_head_dim", "v_head_dim", "kv_lora_rank"),
    "o_proj": ("hidden_size", "num_heads", "v_head_dim"),
}


@dataclass
class MLAConfig:
    num_heads: int
    hidden_size: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    softmax_scale: float
    # rope_inv_freq[layer][p]: inverse frequency of rope pair p (dims p, p + d_r/2) of the shared key.
    rope_inv_freq: list[list[float]]
    rope_attention_scaling: float = 1.0
    q_lora_rank: int | None = None
    q_a_norm: bool = False
    kv_a_norm: bool = False
    q_bias: bool = False
    kv_a_bias: bool = False
    kv_b_bias: bool = False
    o_bias: bool = False
    rms_norm_eps: float = 1e-6
    # QK-norm pre-maps (module docstring): 0 KV heads = none. The source's q/k biases (before the
    # norm) ride on the pre-maps when qk_norm_bias.
    qk_norm_kv_heads: int = 0
    qk_norm_head_dim: int = 0
    qk_norm_bias: bool = False
    qk_norm_offset: float = 0.0
    # Per layer: the sliding window (0: none); empty: no layer has one.
    sliding_windows: list[int] = field(default_factory=list)
    # "auto": absorbed decode for short queries over a cache, expanded K/V otherwise.
    decode: str = "auto"
    absorb_max_query_tokens: int = 8
    # Provenance: the source's geometry and the conversion that produced this model.
    source: dict[str, Any] = field(default_factory=dict)
    method: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even (whole rope pairs), got {self.qk_rope_head_dim}")
        for i, freqs in enumerate(self.rope_inv_freq):
            if len(freqs) != self.qk_rope_head_dim // 2:
                raise ValueError(
                    f"layer {i}: {len(freqs)} rope frequencies for qk_rope_head_dim {self.qk_rope_head_dim}"
                )
        if self.sliding_windows and (len(self.sliding_windows) != len(self.rope_inv_freq) or min(self.sliding_windows) < 0):
            raise ValueError(f"sliding_windows needs one window >= 0 per layer ({len(self.rope_inv_freq)}), "
                             f"got {self.sliding_windows}")
        if self.decode not in ("auto", "absorbed", "expanded"):
            raise ValueError(f"decode must be auto, absorbed or expanded, got {self.decode!r}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def qk_norm(self) -> bool:
        return self.qk_norm_kv_heads > 0

    @property
    def query_input_size(self) -> int:
        """Width of what q_proj / q_a_proj read: x [D], or the normed query heads [H*d_s]."""
        return self.num_heads * self.qk_norm_head_dim if self.qk_norm else self.hidden_size

    @property
    def kv_input_size(self) -> int:
        """Width of what kv_a_proj reads: x [D], or [normed key heads | x] [g*d_s + D]."""
        return self.qk_norm_kv_heads * self.qk_norm_head_dim + self.hidden_size if self.qk_norm else self.hidden_size

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window, 0 for none."""
        return self.sliding_windows[layer] if self.sliding_windows else 0

    @property
    def kv_elements_per_token_per_layer(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def fields_of(self, module: str) -> dict[str, Any]:
        """The config fields that set the shape of an attention projection (its attribute name:
        q_proj, kv_a_proj, ...), for errors that name them; empty for other modules. The QK-norm
        fields only where the model has QK-norm."""
        return {f: getattr(self, f) for f in SHAPE_FIELDS.get(module, ()) if self.qk_norm or f not in _QK}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "MLAConfig":
        return cls(**data)
