"""The tensors of one attention layer, before (source MHA/GQA) and after (MLA) conversion, and
the source layers read from a checkpoint one at a time."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from ..checkpoint.reader import SafetensorsReader
from ..families import AttentionGeometry, attention_geometry, family_for


@dataclass
class SourceAttention:
    """One source attention layer. Weights are [out, in] as in nn.Linear."""

    geometry: AttentionGeometry
    wq: torch.Tensor  # [H*d, D]
    wk: torch.Tensor  # [g*d, D]
    wv: torch.Tensor  # [g*d, D]
    wo: torch.Tensor  # [D, H*d]
    inv_freq: torch.Tensor  # [d/2] per-pair inverse frequency (rotate-half layout)
    bq: torch.Tensor | None = None  # [H*d]
    bk: torch.Tensor | None = None  # [g*d]
    bv: torch.Tensor | None = None  # [g*d]
    bo: torch.Tensor | None = None  # [D]
    # QK-norm (qk_norm.py): per-head RMSNorm weights on queries and keys, before RoPE.
    q_norm: torch.Tensor | None = None  # [d]
    k_norm: torch.Tensor | None = None  # [d]
    norm_eps: float = 1e-6
    norm_offset: float = 0.0  # the norms multiply by (norm_offset + weight) (Gemma: 1)

    @classmethod
    def from_tensors(cls, geometry, inv_freq, tensors: dict[str, torch.Tensor], norm_eps: float = 1e-6,
                     norm_offset: float = 0.0) -> "SourceAttention":
        """tensors: roles q, k, v, o and optional q_bias, k_bias, v_bias, o_bias, q_norm, k_norm (any dtype)."""
        t = {k: v.to(torch.float32) for k, v in tensors.items()}
        g = geometry
        layer = cls(
            geometry, t["q"], t["k"], t["v"], t["o"], inv_freq.float(),
            t.get("q_bias"), t.get("k_bias"), t.get("v_bias"), t.get("o_bias"),
            t.get("q_norm"), t.get("k_norm"), norm_eps, norm_offset,
        )
        if (layer.q_norm is None) != (layer.k_norm is None):
            raise ValueError("a QK-norm source needs both q_norm and k_norm")
        expect = {
            "wq": (g.num_heads * g.head_dim, g.hidden_size),
            "wk": (g.num_kv_heads * g.head_dim, g.hidden_size),
            "wv": (g.num_kv_heads * g.head_dim, g.hidden_size),
            "wo": (g.hidden_size, g.num_heads * g.head_dim),
        }
        if layer.q_norm is not None:
            expect |= {"q_norm": (g.head_dim,), "k_norm": (g.head_dim,)}
        for name, shape in expect.items():
            got = tuple(getattr(layer, name).shape)
            if got != shape:
                raise ValueError(f"{name} has shape {got}, expected {shape} from the config")
        return layer

    def outside_inference(self) -> "SourceAttention":
        """A copy whose value and output tensors are ordinary ones (cloned outside inference mode: autograd may save
        them, as a fit's loss through value_rows and heads_output does); the rest shared."""
        return replace(self, **{f: getattr(self, f).clone() for f in ("wv", "bv", "wo", "bo") if getattr(self, f) is not None})

    def value_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Every KV head's values of x [B, T, D], side by side: [B, T, g*d] (one row per token)."""
        return F.linear(x.to(self.wv.dtype), self.wv, self.bv)

    def heads_output(self, read: torch.Tensor) -> torch.Tensor:
        """The output [B, m, D] of attention weights that read value_rows: read [B, m, H, g*d] (each query head's
        weights over every KV head's values), of which query head h keeps its own KV head's (h // group_size, as
        GQA repeats them), through o_proj."""
        g = self.geometry
        B, m = read.shape[:2]
        own = torch.arange(g.num_heads, device=read.device)  # [H]
        heads = read.view(B, m, g.num_heads, g.num_kv_heads, g.head_dim)[:, :, own, own // g.group_size]  # [B, m, H, d]
        return F.linear(heads.reshape(B, m, -1), self.wo.to(heads.dtype), None if self.bo is None else self.bo.to(heads.dtype))


@dataclass
class MLALayer:
    """One converted layer in the native MLA layout (MLAAttention's parameter names)."""

    q_proj: torch.Tensor  # [H*(d_nope+d_r), D]   per head: [nope | rope]
    kv_a_proj: torch.Tensor  # [d_c + d_r, D]     [latent | shared rope key]
    kv_b_proj: torch.Tensor  # [H*(d_nope+d_v), d_c] per head: [W_UK | W_UV]
    o_proj: torch.Tensor  # [D, H*d_v]
    rope_inv_freq: torch.Tensor  # [d_r/2]
    q_bias: torch.Tensor | None = None
    kv_a_bias: torch.Tensor | None = None
    kv_b_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    kv_a_norm: torch.Tensor | None = None  # [d_c] RMSNorm weight on the latent
    # Optional low-rank query: q = q_b_proj(q_a_proj x) replaces q_proj.
    q_a_proj: torch.Tensor | None = None  # [d_q, D]
    q_b_proj: torch.Tensor | None = None  # [H*(d_nope+d_r), d_q]
    # QK-norm pre-maps (qk_norm.py): q_proj / q_a_proj then read the normed query heads [H*d_s] and
    # kv_a_proj reads [normed key heads | x] [g*d_s + D].
    q_pre_proj: torch.Tensor | None = None  # [H*d_s, D] the source's q_proj
    q_pre_bias: torch.Tensor | None = None  # [H*d_s]
    q_norm: torch.Tensor | None = None  # [d_s]
    k_pre_proj: torch.Tensor | None = None  # [g*d_s, D] the source's k_proj
    k_pre_bias: torch.Tensor | None = None  # [g*d_s]
    k_norm: torch.Tensor | None = None  # [d_s]

    def _parameter_fields(self) -> dict[str, str]:
        """MLAAttention's parameter name -> this dataclass's field, for this layer's query form."""
        names = {
            "kv_a_proj.weight": "kv_a_proj",
            "kv_a_proj.bias": "kv_a_bias",
            "kv_a_norm.weight": "kv_a_norm",
            "kv_b_proj.weight": "kv_b_proj",
            "kv_b_proj.bias": "kv_b_bias",
            "o_proj.weight": "o_proj",
            "o_proj.bias": "o_bias",
        }
        if self.k_norm is not None:
            names.update({"q_pre_proj.weight": "q_pre_proj", "q_pre_proj.bias": "q_pre_bias", "q_norm.weight": "q_norm",
                          "k_pre_proj.weight": "k_pre_proj", "k_pre_proj.bias": "k_pre_bias", "k_norm.weight": "k_norm"})
        if self.q_a_proj is not None:
            names.update({"q_a_proj.weight": "q_a_proj", "q_b_proj.weight": "q_b_proj", "q_b_proj.bias": "q_bias"})
        else:
            names.update({"q_proj.weight": "q_proj", "q_proj.bias": "q_bias"})
        return names

    def state_dict(self, prefix: str) -> dict[str, torch.Tensor]:
        """Tensors named as MLAAttention's parameters under `prefix` (e.g. model.layers.0.self_attn.)."""
        tensors = {k: getattr(self, f) for k, f in self._parameter_fields().items()}
        return {prefix + k: v for k, v in tensors.items() if v is not None}

    def with_tensors(self, tensors: dict[str, torch.Tensor]) -> "MLALayer":
        """A copy whose tensors are replaced by `tensors` (named as state_dict("") names them; each
        cast to the dtype it replaces); the rope frequencies are kept."""
        return replace(self, **{f: tensors[k].to(getattr(self, f).dtype)
                                for k, f in self._parameter_fields().items() if getattr(self, f) is not None})


def read_source_attention(reader: SafetensorsReader, config, layer: int) -> SourceAttention:
    family = family_for(config)
    names = family.attention_names(config, layer)
    missing = [n for n in names.values() if n not in reader]
    if missing:
        raise KeyError(f"source checkpoint lacks {missing[0]} (layer {layer})")
    inv_freq, _ = family.rope(config, layer)
    return SourceAttention.from_tensors(attention_geometry(config), inv_freq, {r: reader.get(n) for r, n in names.items()},
                                        norm_eps=getattr(config, "rms_norm_eps", 1e-6), norm_offset=family.qk_norm_offset)


def source_layers(source_dir: Path, config) -> Iterator[SourceAttention]:
    """Each layer's source attention, read one layer at a time."""
    with SafetensorsReader(source_dir) as reader:
        for i in range(attention_geometry(config).num_layers):
            yield read_source_attention(reader, config, i)
