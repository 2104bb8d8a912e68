"""Key/value replication: a GQA/MHA layer written exactly as MLA (ALGORITHMS.md, lossless).

Latent c = W_V x (g*d dims); W_UV[h] selects group h//n's slice. The shared rope key is all g key
heads side by side, re-laid so that the shared key is itself rotate-half: pair p = j*(d/2) + i
is head j's pair i, dims (p, p + g*d/2). Query head h keeps its own pairs in its group's slot and
zeros elsewhere, so q_h,rope . k_r = q_h . k_(h//n). d_nope = 0, scale 1/sqrt(d).
"""

from __future__ import annotations

import torch

from .layers import MLALayer, SourceAttention


def rope_pair_rows(num_heads: int, head_dim: int) -> torch.Tensor:
    """Row order that turns `num_heads` rotate-half heads into one rotate-half vector.

    Returns [num_heads*head_dim] indices: first halves of all heads, then second halves.
    """
    half = head_dim // 2
    base = torch.arange(num_heads)[:, None] * head_dim + torch.arange(half)[None, :]  # [heads, d/2]
    return torch.cat((base.reshape(-1), (base + half).reshape(-1)))


def slot_queries(wq: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Place each query head in its KV group's slot of the shared rope layout (zeros elsewhere).

    wq [H*d, rows_in] -> [H, g*d, rows_in], rows in rope_pair_rows(g, d) order.
    """
    n, half = num_heads // num_kv_heads, head_dim // 2
    q = wq.view(num_heads, head_dim, -1)
    out = q.new_zeros(num_heads, num_kv_heads * head_dim, q.shape[-1])
    for h in range(num_heads):
        j = h // n
        out[h, j * half : (j + 1) * half] = q[h, :half]
        out[h, num_kv_heads * half + j * half : num_kv_heads * half + (j + 1) * half] = q[h, half:]
    return out


def group_selector(num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """W_UV for replication: [H*d, g*d], head h reads group h//n's d dims of the latent."""
    n = num_heads // num_kv_heads
    sel = torch.zeros(num_heads, head_dim, num_kv_heads * head_dim)
    for h in range(num_heads):
        j = h // n
        sel[h, :, j * head_dim : (j + 1) * head_dim] = torch.eye(head_dim)
    return sel.reshape(num_heads * head_dim, num_kv_heads * head_dim)


def replicate(src: SourceAttention) -> MLALayer:
    """The exact (lossless) MLA form of a source layer; cache 2*g*d, like the source."""
    g = src.geometry
    H, kv, d = g.num_heads, g.num_kv_heads, g.head_dim
    rows = rope_pair_rows(kv, d)
    q_proj = slot_queries(src.wq, H, kv, d).reshape(H * kv * d, -1)  # [H*(0 + g*d), D]
    q_bias = None if src.bq is None else slot_queries(src.bq[:, None], H, kv, d).reshape(-1)
    kv_a = torch.cat((src.wv, src.wk[rows]))  # [g*d + g*d, D]
    kv_a_bias = None
    if src.bk is not None or src.bv is not None:
        bk = src.bk if src.bk is not None else src.wk.new_zeros(kv * d)
        bv = src.bv if src.bv is not None else src.wv.new_zeros(kv * d)
        kv_a_bias = torch.cat((bv, bk[rows]))
    return MLALayer(
        q_proj=q_proj,
        q_bias=q_bias,
        kv_a_proj=kv_a,
        kv_a_bias=kv_a_bias,
        kv_b_proj=group_selector(H, kv, d),  # [H*(0 + d), g*d]
        o_proj=src.wo,
        o_bias=src.bo,
        rope_inv_freq=src.inv_freq.repeat(kv),  # pair p -> frequency of pair p % (d/2)
    )
