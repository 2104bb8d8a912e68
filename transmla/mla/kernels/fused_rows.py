"""Absorbed MLA attention over cached rows [c | k_r]: one SDPA call with one KV head (CPU fast path).

Notation as in reference.py. The cache row of a token is [c | k_r] (d_c + d_r values); the query
of head h is [q_lat,h | q_rope,h]. A score is one dot product of the two rows, and the value can
be the whole row too: the output's first d_c columns are sum_s p_s c_s, the last d_r columns are
dropped. With key = value = rows every operand has the same width, so PyTorch's fused
(flash) SDPA kernel on the CPU takes it: scores, softmax and the output product in one pass
over the cache, nothing of size S materialised per head, fp32 or bf16.

One new token per sequence on the CPU without a mask (decode) goes to a kernel of cpu_decode.py
when it is built (fp32: about a third less time than SDPA here; bf16 on AMX tiles: 2.5-3x less,
kernels/NOTES.md), and many (prefill) to one of cpu_prefill.py (value product on the d_c value
columns only).
Otherwise, layouts: a few queries without a mask fold the T*H query rows of a sequence into one
"head" of length T*H against the one KV head, so the cache of a sequence is read once for all
heads. Many queries (prefill) or a padding mask: H query heads against one KV head
(``enable_gqa``), SDPA's causal flag when there is no mask, else the given boolean mask.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from .cpu_decode import mla_decode_cpu
from .cpu_prefill import mla_prefill_cpu

__all__ = ["attend_rows"]


def attend_rows(
    q_rows: torch.Tensor,  # [B, T, H, d_c + d_r] = [q_lat | q_rope]; the queries are the last T positions
    rows: torch.Tensor,  # [B, S, d_c + d_r] = [c | k_r]
    d_c: int,
    softmax_scale: float,
    mask: torch.Tensor | None = None,  # bool [B|1, 1, T, S], True = attend; None = bottom-right causal
    fold_max_queries: int = 8,
) -> torch.Tensor:  # [B, T, H, d_c]
    B, T, H, width = q_rows.shape
    S = rows.shape[1]
    if mask is not None and rows.device.type == "cpu" and _plain_causal(mask, T, S):  # (no device sync)
        mask = None  # e.g. transformers' mask for a chunk after the cache: the kernels and SDPA's causal flag
    if mask is None and T == 1:
        with _profiled("transmla::cpu_decode_kernel"):
            out = mla_decode_cpu(q_rows, rows, d_c, softmax_scale)  # [B, 1, H, d_c], None where it cannot run
        if out is not None:
            return out
    kv = rows[:, None]  # [B, 1, S, d_c + d_r]: one KV head, value = key
    if mask is None and T <= fold_max_queries:
        q = q_rows.reshape(B, 1, T * H, width)  # [B, 1, T*H, d_c + d_r], row m = t*H + h
        causal = None
        if T > 1:  # query t sees keys s <= S - T + t
            limit = torch.arange(T, device=rows.device).repeat_interleave(H) + (S - T)  # [T*H]
            causal = torch.arange(S, device=rows.device)[None, :] <= limit[:, None]  # [T*H, S]
        out = F.scaled_dot_product_attention(q, kv, kv, attn_mask=causal, scale=softmax_scale)  # [B, 1, T*H, w]
        return out[..., :d_c].reshape(B, T, H, d_c)
    if mask is None:
        with _profiled("transmla::cpu_prefill_kernel"):
            out = mla_prefill_cpu(q_rows, rows, d_c, softmax_scale)  # [B, T, H, d_c], None where it cannot run
        if out is not None:
            return out
    q = q_rows.transpose(1, 2)  # [B, H, T, d_c + d_r]
    if mask is None and T != S:  # a chunk after cached tokens: bottom-right causal
        limit = torch.arange(T, device=rows.device)[:, None] + (S - T)
        mask = torch.arange(S, device=rows.device)[None, :] <= limit  # [T, S]
    out = F.scaled_dot_product_attention(
        q, kv, kv, attn_mask=mask, is_causal=mask is None, scale=softmax_scale, enable_gqa=True
    )  # [B, H, T, d_c + d_r]
    return out[..., :d_c].transpose(1, 2)  # [B, T, H, d_c]


def _profiled(name: str):
    """A named range for torch's profiler while one records (the C kernels' ctypes calls are invisible
    to it; `transmla bench generate --profile-steps`), else nothing."""
    return torch.profiler.record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


def _plain_causal(mask: torch.Tensor, T: int, S: int) -> bool:
    """Is the boolean mask [B|1, 1, T, S] exactly the bottom-right causal one (no padding)? Checking
    costs B * T * S comparisons, a small part of the attention's B * T * S * H * W multiply-adds."""
    if mask.dtype != torch.bool or tuple(mask.shape[-2:]) != (T, S):
        return False
    limit = torch.arange(T, device=mask.device)[:, None] + (S - T)
    return bool((mask == (torch.arange(S, device=mask.device)[None, :] <= limit)).all())
