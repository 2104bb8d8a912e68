"""QK-norm sources (Qwen3) as plain linear sources over a wider input, so every method runs unchanged.

ALGORITHMS.md "QK-norm". Source query head h: q_h = RoPE(q~_h), q~ = g_q * n(W_q x + b_q) per head;
key head j: k_j = RoPE(k~_j), k~ = g_k * n(W_k x + b_k) per head; v = W_v x + b_v.
Over the input u = [q~ (H*d); k~ (g*d); x (D)] that layer is linear: queries = [I 0 0] u, keys =
[0 I 0] u, values = [0 0 W_v] u + b_v. `linear_source` is that plain source and `source_inputs`
maps x to u, so the calibration gram is E[[u;1][u;1]^T]: a method's key moments are moments of the
normed keys, its query moments those of the normed queries, and its proofs of exactness hold as
they are. The MLA layer a method makes of it reads only q~ in its query linear and only [k~; x] in
kv_a_proj (the other columns are zero: every map it builds is linear in the source's maps);
`attach_pre_maps` drops those columns and adds the source's q/k projections and norms as the
layer's pre-maps, which MLAAttention applies itself (q~ on the query side, k~ when a cache row is
written). Plain sources pass through all three functions unchanged.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from ..mla.attention import head_rms_norm
from .layers import MLALayer, SourceAttention


def source_inputs(src: SourceAttention, x: torch.Tensor) -> torch.Tensor:
    """x [n, D] -> u = [q~; k~; x] [n, H*d + g*d + D] for a QK-norm source, else x itself."""
    if src.k_norm is None:
        return x
    bias = lambda b: None if b is None else b.to(x)  # noqa: E731
    q = head_rms_norm(F.linear(x, src.wq.to(x), bias(src.bq)), src.q_norm.to(x), src.norm_eps, src.norm_offset)  # [n, H*d]
    k = head_rms_norm(F.linear(x, src.wk.to(x), bias(src.bk)), src.k_norm.to(x), src.norm_eps, src.norm_offset)  # [n, g*d]
    return torch.cat((q, k, x), dim=-1)


def linear_source(src: SourceAttention) -> SourceAttention:
    """The plain source over u = [q~; k~; x] of a QK-norm source (module docstring), else `src`."""
    if src.k_norm is None:
        return src
    q_width, k_width = src.wq.shape[0], src.wk.shape[0]
    D = src.wq.shape[1]
    zeros = src.wq.new_zeros
    eye = lambda n: torch.eye(n, dtype=src.wq.dtype)  # noqa: E731
    wq = torch.cat((eye(q_width), zeros(q_width, k_width + D)), dim=1)  # [H*d, H*d + g*d + D]
    wk = torch.cat((zeros(k_width, q_width), eye(k_width), zeros(k_width, D)), dim=1)  # [g*d, H*d + g*d + D]
    wv = torch.cat((zeros(src.wv.shape[0], q_width + k_width), src.wv), dim=1)  # [g*d, H*d + g*d + D]
    return SourceAttention(src.geometry, wq, wk, wv, src.wo, src.inv_freq, bv=src.bv, bo=src.bo)


def attach_pre_maps(layer: MLALayer, src: SourceAttention) -> MLALayer:
    """A method's MLA layer over u (from linear_source(src)) as the layer MLAAttention runs: the query
    linear keeps its q~ columns, kv_a_proj its [k~; x] columns, and the source's q/k projections,
    biases and norms become the pre-maps. `layer` itself for a plain source."""
    if src.k_norm is None:
        return layer
    q_width = src.wq.shape[0]
    q_field = "q_a_proj" if layer.q_a_proj is not None else "q_proj"
    query = getattr(layer, q_field)  # [out, H*d + g*d + D]
    dropped = {q_field: query[:, q_width:], "kv_a_proj": layer.kv_a_proj[:, :q_width]}
    for name, cols in dropped.items():
        if torch.count_nonzero(cols):
            raise ValueError(f"{name} of a QK-norm conversion reads inputs its pre-map does not give it")
    return replace(
        layer,
        **{q_field: query[:, :q_width]},  # [out, H*d]
        kv_a_proj=layer.kv_a_proj[:, q_width:],  # [d_c + d_r, g*d + D]
        q_pre_proj=src.wq, q_pre_bias=src.bq, q_norm=src.q_norm,
        k_pre_proj=src.wk, k_pre_bias=src.bk, k_norm=src.k_norm,
    )


__all__ = ["attach_pre_maps", "linear_source", "source_inputs"]
