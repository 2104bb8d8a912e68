"""MHA2MLA step 1, partial-RoPE: keep RoPE on P frequency pairs per key head, drop it on the rest.

ALGORITHMS.md, MHA2MLA 1 (Ji et al. 2025, arXiv 2502.14837, section 3.2). Pair i of a head is
dims (i, i + d/2) (rotate-half layout), inverse frequency w_i, pair 0 rotating fastest.
Selection strategies, each returning sorted pair indices [g, P] (one row per key head):
- high:    0 .. P-1 (the highest frequencies);
- low:     d/2-P .. d/2-1 (the lowest);
- uniform: floor(k * (d/2) / P), k = 0..P-1 — every (d/2)/P-th pair from 0 when P divides d/2
           (the public code's start point 0), evenly spread otherwise;
- 2norm:   the top P of score_j,i = sum_{h in group j} mean_t|q_h,i| * mean_t|k_j,i|, per layer
           and key head (|.| the 2-norm of the pair, which RoPE does not change).
For GQA the selection is per key head and its query group reads the same pairs.

The layer: start from the exact replicated layer (replicate.replicate), whose shared rope key
holds every pair of every key head (pair p = j*(d/2) + i, dims (p, p + g*d/2)). Kept pairs stay in
the shared rope key with their exact frequencies (g*2P dims); the other pairs lose their rotation
and move to the no-position part: key dims join the latent as K_nope (d - 2P dims per key head),
query dims become q_nope, read back by W_UK as a selector. The latent is then [K_nope; V]
(g*(2d - 2P) dims), uncompressed; svd.compress_latent truncates it. Exact when every pair is
kept: only the dropped rotations change any score.
"""

from __future__ import annotations

import torch

from ..layers import MLALayer

STRATEGIES = ("high", "low", "uniform", "2norm")


# -- selection ------------------------------------------------------------------------------------


def _check(num_pairs: int, keep: int) -> None:
    if not 0 <= keep <= num_pairs:
        raise ValueError(f"cannot keep {keep} rope pairs of a head with {num_pairs} pairs (head_dim {2 * num_pairs})")


def high_pairs(num_pairs: int, keep: int) -> torch.Tensor:
    """The `keep` highest-frequency pairs: 0..keep-1. num_pairs = d/2."""
    _check(num_pairs, keep)
    return torch.arange(keep)  # [P]


def low_pairs(num_pairs: int, keep: int) -> torch.Tensor:
    """The `keep` lowest-frequency pairs: d/2-keep..d/2-1."""
    _check(num_pairs, keep)
    return torch.arange(num_pairs - keep, num_pairs)  # [P]


def uniform_pairs(num_pairs: int, keep: int) -> torch.Tensor:
    """`keep` pairs spread evenly from pair 0: step (d/2)/P when it divides."""
    _check(num_pairs, keep)
    return torch.arange(keep) * num_pairs // keep  # [P] floor(k * num_pairs / keep), distinct


def two_norm_scores(q_pair_norm: torch.Tensor, k_pair_norm: torch.Tensor) -> torch.Tensor:
    """score_j,i = sum over key head j's query group of mean|q_h,i| * mean|k_j,i|.

    q_pair_norm [H, d/2], k_pair_norm [g, d/2] (means over calibration tokens) -> [g, d/2].
    """
    H, half = q_pair_norm.shape
    g = k_pair_norm.shape[0]
    if H % g or k_pair_norm.shape[1] != half:
        raise ValueError(f"pair norms of shapes {tuple(q_pair_norm.shape)} and {tuple(k_pair_norm.shape)} do not match")
    q_group = q_pair_norm.double().view(g, H // g, half).sum(1)  # [g, d/2] heads h = j*n .. j*n+n-1
    return q_group * k_pair_norm.double()  # [g, d/2]


def top_pairs(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """The `keep` highest-scoring pairs of each key head, sorted by index. scores [g, d/2] -> [g, P].

    Ties go to the lower index (the higher frequency): a stable descending sort.
    """
    _check(scores.shape[1], keep)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices  # [g, d/2]
    return order[:, :keep].sort(dim=1).values  # [g, P]


def select_pairs(
    strategy: str,
    num_kv_heads: int,
    head_dim: int,
    keep: int,
    q_pair_norm: torch.Tensor | None = None,
    k_pair_norm: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pair indices kept as rope for every key head of one layer: LongTensor [g, P], sorted rows."""
    half = head_dim // 2
    if strategy == "2norm":
        if q_pair_norm is None or k_pair_norm is None:
            raise ValueError("the 2norm rope selection needs calibration pair norms")
        if k_pair_norm.shape[0] != num_kv_heads:
            raise ValueError(f"k_pair_norm has {k_pair_norm.shape[0]} heads, expected {num_kv_heads}")
        return top_pairs(two_norm_scores(q_pair_norm, k_pair_norm), keep)
    fixed = {"high": high_pairs, "low": low_pairs, "uniform": uniform_pairs}
    if strategy not in fixed:
        raise ValueError(f"unknown rope selection {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    return fixed[strategy](half, keep)[None].expand(num_kv_heads, -1).clone()  # [g, P]


# -- the layer ------------------------------------------------------------------------------------


def _complement(pairs: torch.Tensor, half: int) -> torch.Tensor:
    """Per row, the pair indices not in `pairs` (sorted). [g, P] -> [g, d/2 - P]."""
    kept = torch.zeros(pairs.shape[0], half, dtype=torch.bool)
    kept.scatter_(1, pairs, True)
    return torch.stack([torch.nonzero(~row).flatten() for row in kept]) if half > pairs.shape[1] else pairs.new_zeros(pairs.shape[0], 0)


def partial_rope_rows(pairs: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the replicated shared rope key (g*d dims) that stay rope, and that become NoPE.

    pairs [g, P] -> rope rows [g*2P] (rotate-half: kept pair p' = j*P + k is dims (p', p' + g*P))
    and nope rows [g*(d-2P)] grouped by key head: head j's dropped pairs' first then second halves.
    """
    g, P = pairs.shape
    half = head_dim // 2
    if pairs.numel() and (pairs.min() < 0 or pairs.max() >= half):
        raise ValueError(f"rope pair indices must lie in 0..{half - 1}")
    if any(row.unique().numel() != P for row in pairs):
        raise ValueError("rope pair indices repeat within a key head")
    offset = torch.arange(g)[:, None] * half  # [g, 1] head j's pairs start at j*(d/2)
    kept = (pairs + offset).reshape(-1)  # [g*P] pair indices in the shared key
    rope = torch.cat((kept, kept + g * half))  # [g*2P]
    dropped = _complement(pairs, half) + offset  # [g, d/2-P]
    nope = torch.cat((dropped, dropped + g * half), dim=1).reshape(-1)  # [g*(d-2P)] per head: halves
    return rope, nope


def partial_rope(rep: MLALayer, pairs: torch.Tensor, num_heads: int, head_dim: int) -> MLALayer:
    """Partial-RoPE form of a replicated layer (replicate.replicate), latent [K_nope; V] uncompressed.

    rep: d_nope = 0, d_r = g*d, latent = V (g*d), kv_b = group selector. pairs [g, P] kept per key
    head. Result: d_nope = d - 2P, d_r = g*2P, d_c = g*(d-2P) + g*d, d_v = d.
    """
    g, P = pairs.shape
    H, d = num_heads, head_dim
    n, gd, dn = H // g, g * head_dim, head_dim - 2 * P
    if rep.kv_a_proj.shape[0] != 2 * gd or rep.rope_inv_freq.numel() != gd // 2:
        raise ValueError("partial_rope expects a replicated layer (replicate.replicate)")
    rope_rows, nope_rows = partial_rope_rows(pairs, head_dim)
    v_w, key_w = rep.kv_a_proj[:gd], rep.kv_a_proj[gd:]  # [g*d, D] each; key in the shared rope layout
    kv_a = torch.cat((key_w[nope_rows], v_w, key_w[rope_rows]))  # [g*(d-2P) + g*d + g*2P, D]
    kv_a_bias = None
    if rep.kv_a_bias is not None:
        v_b, key_b = rep.kv_a_bias[:gd], rep.kv_a_bias[gd:]
        kv_a_bias = torch.cat((key_b[nope_rows], v_b, key_b[rope_rows]))

    # Queries: slot layout [H, g*d, D]; head h's NoPE dims are its group's dropped dims.
    q_slot = rep.q_proj.view(H, gd, -1)
    nope_of = nope_rows.view(g, dn)  # [g, d-2P] group j's rows
    heads = torch.arange(H)
    q_nope = q_slot[heads[:, None], nope_of[heads // n]]  # [H, d-2P, D]
    q_rope = q_slot[:, rope_rows]  # [H, g*2P, D] zero outside the head's own group
    q_proj = torch.cat((q_nope, q_rope), dim=1).reshape(H * (dn + 2 * g * P), -1)
    q_bias = None
    if rep.q_bias is not None:
        qb = rep.q_bias.view(H, gd)
        q_bias = torch.cat((qb[heads[:, None], nope_of[heads // n]], qb[:, rope_rows]), dim=1).reshape(-1)

    # W_UK[h] reads group j's K_nope block, W_UV[h] its V block of the latent [K_nope; V].
    latent = g * dn + gd
    kv_b = torch.zeros(H, dn + d, latent)
    for h in range(H):
        j = h // n
        kv_b[h, :dn, j * dn : (j + 1) * dn] = torch.eye(dn)
        kv_b[h, dn:, g * dn + j * d : g * dn + (j + 1) * d] = torch.eye(d)
    return MLALayer(
        q_proj=q_proj,
        q_bias=q_bias,
        kv_a_proj=kv_a,
        kv_a_bias=kv_a_bias,
        kv_b_proj=kv_b.reshape(H * (dn + d), latent),  # [H*(d_nope + d_v), d_c]
        o_proj=rep.o_proj,
        o_bias=rep.o_bias,
        rope_inv_freq=rep.rope_inv_freq[rope_rows[: g * P]],  # kept pairs keep their exact frequency
    )


def key_latent_dims(num_kv_heads: int, head_dim: int, keep: int) -> int:
    """How many of the partial-RoPE latent's leading dims are K_nope: g*(d - 2P)."""
    return num_kv_heads * (head_dim - 2 * keep)
