"""Sliding-window attention over cached rows: which rows a call's queries may see, and its mask.

A query at cache index i attends to the keys j with i - w < j <= i (transformers'
sliding_window_causal: kv_idx > q_idx - w). The T queries of a call are the last T of the S cached
rows (indices S - T .. S - 1; on a bounded LatentCache the S rows are the last S tokens', and the
indices count from the first of them), so no query sees a row before S - T - w + 1: those rows are dropped
(the caller slices a view), and for one query (decode) the w rows left are exactly its window, so
no mask is needed and the CPU decode kernel runs over them unchanged.
"""

from __future__ import annotations

import torch

__all__ = ["sliding_window"]


def sliding_window(
    mask: torch.Tensor | None,  # bool [B|1, 1, T, S] (True = attend) or None (bottom-right causal)
    q_len: int,
    kv_len: int,
    window: int,
    device,
) -> tuple[int, torch.Tensor | None]:
    """(first row kept, the mask over the kept rows [B|1, 1, T, S - first] or None) for a window of
    `window` tokens; (0, mask) when no query sees more than `window` rows (kv_len <= window)."""
    if kv_len <= window:
        return 0, mask
    start = max(0, kv_len - q_len - window + 1)
    if mask is not None:
        mask = mask[..., start:]  # [B|1, 1, T, S - start]
    if q_len == 1:  # the kept rows are the query's window: causal and padding alone decide
        return start, mask
    q_at = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)  # [T, 1] cache index of each query
    k_at = torch.arange(start, kv_len, device=device)[None, :]  # [1, S - start]
    band = ((k_at <= q_at) & (k_at > q_at - window))[None, None]  # [1, 1, T, S - start]
    return start, band if mask is None else band & mask
