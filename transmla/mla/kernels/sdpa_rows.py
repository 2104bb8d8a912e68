"""Absorbed MLA attention over cached rows [c | k_r] in PyTorch's SDPA with one KV head: the backend that
takes every call (backends.py falls back to it), on every device.

Notation as in reference.py. The cache row of a token is [c | k_r] (d_c + d_r values); the query
of head h is [q_lat,h | q_rope,h]. A score is one dot product of the two rows, and the value can
be the whole row too: the output's first d_c columns are sum_s p_s c_s, the last d_r columns are
dropped. With key = value = rows every operand has the same width, so PyTorch's fused
(flash) SDPA kernel on the CPU takes it: scores, softmax and the output product in one pass
over the cache, nothing of size S materialised per head, fp32 or bf16.

Layouts: a decode step (a few queries) without a mask folds the T*H query rows of a sequence into one
"head" of length T*H against the one KV head, so the cache of a sequence is read once for all heads.
A prompt, or a padding mask: H query heads against one KV head (``enable_gqa``), SDPA's causal flag
when there is no mask, else the given boolean mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["sdpa_decode", "sdpa_prefill"]


def sdpa_decode(
    q_rows: torch.Tensor,  # [B, T, H, d_c + d_r] = [q_lat | q_rope]; the queries are the last T positions
    rows: torch.Tensor,  # [B, S, d_c + d_r] = [c | k_r]
    d_c: int,
    softmax_scale: float,
    mask: torch.Tensor | None = None,  # bool [B|1, 1, T, S], True = attend; None = bottom-right causal
) -> torch.Tensor:  # [B, T, H, d_c]
    if mask is not None:
        return sdpa_prefill(q_rows, rows, d_c, softmax_scale, mask)
    B, T, H, width = q_rows.shape
    S = rows.shape[1]
    kv = rows[:, None]  # [B, 1, S, d_c + d_r]: one KV head, value = key
    q = q_rows.reshape(B, 1, T * H, width)  # [B, 1, T*H, d_c + d_r], row m = t*H + h
    causal = None
    if T > 1:  # query t sees keys s <= S - T + t
        limit = torch.arange(T, device=rows.device).repeat_interleave(H) + (S - T)  # [T*H]
        causal = torch.arange(S, device=rows.device)[None, :] <= limit[:, None]  # [T*H, S]
    out = F.scaled_dot_product_attention(q, kv, kv, attn_mask=causal, scale=softmax_scale)  # [B, 1, T*H, w]
    return out[..., :d_c].reshape(B, T, H, d_c)


def sdpa_prefill(
    q_rows: torch.Tensor,  # [B, T, H, d_c + d_r]
    rows: torch.Tensor,  # [B, S, d_c + d_r]
    d_c: int,
    softmax_scale: float,
    mask: torch.Tensor | None = None,  # bool [B|1, 1, T, S]; None = bottom-right causal
) -> torch.Tensor:  # [B, T, H, d_c]
    T, S = q_rows.shape[1], rows.shape[1]
    kv = rows[:, None]  # [B, 1, S, d_c + d_r]: one KV head, value = key
    q = q_rows.transpose(1, 2)  # [B, H, T, d_c + d_r]
    if mask is None and T != S:  # a chunk after cached tokens: bottom-right causal
        limit = torch.arange(T, device=rows.device)[:, None] + (S - T)
        mask = torch.arange(S, device=rows.device)[None, :] <= limit  # [T, S]
    out = F.scaled_dot_product_attention(
        q, kv, kv, attn_mask=mask, is_causal=mask is None, scale=softmax_scale, enable_gqa=True
    )  # [B, H, T, d_c + d_r]
    return out[..., :d_c].transpose(1, 2)  # [B, T, H, d_c]
