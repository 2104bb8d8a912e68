"""PyTorch reference for absorbed MLA decode (the twin every kernel is tested against).

Notation (ALGORITHMS.md, "MLA attention"): B batch, T_q new query tokens per sequence, H query
heads, S cache capacity, d_c latent width (kv_lora_rank), d_r shared rope-key width.
Absorbed decode is MQA with one KV head of width d_c + d_r whose value is the first d_c columns:

    score[b,t,h,s] = (q_lat[b,t,h] . latent[b,s] + q_rope[b,t,h] . rope_key[b,s]) * softmax_scale
    o_lat[b,t,h]   = sum_s softmax_s(score[b,t,h,:]) * latent[b,s]

The T_q queries of sequence b are its last T_q positions: with L_b = seq_lens[b] (the cache
already holds the new tokens), query t sees keys s < L_b - T_q + t + 1. Positions s >= L_b are
padding: never read into the result (NaN there does not leak). seq_lens is clamped to [0, S];
a query that sees no key at all (L_b < T_q - t) gets a zero output row.
"""

from __future__ import annotations

import torch

__all__ = ["mla_decode_reference", "check_decode_shapes"]


def check_decode_shapes(
    q_lat: torch.Tensor,
    q_rope: torch.Tensor,
    latent: torch.Tensor,
    rope_key: torch.Tensor,
    seq_lens: torch.Tensor | None,
) -> tuple[int, int, int, int, int, int]:
    """Validate the decode operands; return (B, T_q, H, S, d_c, d_r)."""
    if q_lat.dim() != 4 or q_rope.dim() != 4:
        raise ValueError(
            f"q_lat/q_rope must be [B, T_q, H, d]; got {tuple(q_lat.shape)} and {tuple(q_rope.shape)}"
        )
    if latent.dim() != 3 or rope_key.dim() != 3:
        raise ValueError(
            f"latent/rope_key must be [B, S, d]; got {tuple(latent.shape)} and {tuple(rope_key.shape)}"
        )
    B, T_q, H, d_c = q_lat.shape
    d_r = q_rope.shape[-1]
    S = latent.shape[1]
    if tuple(q_rope.shape[:3]) != (B, T_q, H):
        raise ValueError(f"q_rope {tuple(q_rope.shape)} does not match q_lat {tuple(q_lat.shape)}")
    if tuple(latent.shape) != (B, S, d_c):
        raise ValueError(f"latent {tuple(latent.shape)} != [B={B}, S, d_c={d_c}]")
    if tuple(rope_key.shape) != (B, S, d_r):
        raise ValueError(f"rope_key {tuple(rope_key.shape)} != [B={B}, S={S}, d_r={d_r}]")
    if seq_lens is not None:
        if seq_lens.dim() != 1 or seq_lens.shape[0] != B:
            raise ValueError(f"seq_lens must be [B={B}]; got {tuple(seq_lens.shape)}")
        if seq_lens.dtype.is_floating_point or seq_lens.dtype == torch.bool:
            raise ValueError(f"seq_lens must be an integer tensor; got {seq_lens.dtype}")
    return B, T_q, H, S, d_c, d_r


def mla_decode_reference(
    q_lat: torch.Tensor,  # [B, T_q, H, d_c]
    q_rope: torch.Tensor,  # [B, T_q, H, d_r]
    latent: torch.Tensor,  # [B, S, d_c]
    rope_key: torch.Tensor,  # [B, S, d_r]
    softmax_scale: float,
    seq_lens: torch.Tensor | None = None,  # [B] int, None = all S
) -> torch.Tensor:  # [B, T_q, H, d_c], q_lat's dtype
    """Absorbed MLA decode in plain PyTorch (fp32 accumulation, float64 stays float64)."""
    B, T_q, H, S, d_c, d_r = check_decode_shapes(q_lat, q_rope, latent, rope_key, seq_lens)
    device = q_lat.device
    cdt = torch.promote_types(q_lat.dtype, torch.float32)

    pos = torch.arange(S, device=device)  # [S]
    if seq_lens is None:
        L = torch.full((B,), S, device=device, dtype=torch.long)
    else:
        L = seq_lens.to(device=device, dtype=torch.long).clamp(0, S)  # [B]
    valid = pos[None, :] < L[:, None]  # [B, S]  real cache rows
    # query t (0-based) of sequence b sits at position L_b - T_q + t: it sees s <= that position
    lim = L[:, None] - T_q + torch.arange(T_q, device=device)[None, :] + 1  # [B, T_q]
    visible = pos[None, None, :] < lim[:, :, None]  # [B, T_q, S]

    c = latent.to(cdt).masked_fill(~valid[:, :, None], 0.0)  # [B, S, d_c]
    kr = rope_key.to(cdt).masked_fill(~valid[:, :, None], 0.0)  # [B, S, d_r]
    scores = torch.einsum("bthc,bsc->bths", q_lat.to(cdt), c)  # [B, T_q, H, S]
    if d_r > 0:
        scores = scores + torch.einsum("bthr,bsr->bths", q_rope.to(cdt), kr)
    scores = scores * softmax_scale
    scores = scores.masked_fill(~visible[:, :, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1)  # [B, T_q, H, S]; NaN on rows that see nothing
    p = p.masked_fill(~visible.any(-1)[:, :, None, None], 0.0)
    o = torch.einsum("bths,bsc->bthc", p, c)  # [B, T_q, H, d_c]
    return o.to(q_lat.dtype)
