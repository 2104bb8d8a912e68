"""Held-out perplexity during a run (eval.* of the recipe): the evaluation text's tokens, and the
perplexity on its first windows, also at the in-training window count when more are asked."""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch

from .recipe import Recipe


def held_out_ids(recipe: Recipe, tokenizer) -> torch.Tensor | None:
    from ..data.texts import load_text
    from ..eval.perplexity import tokenize_text

    e = recipe.eval
    if e.data is None:
        return None
    return tokenize_text(tokenizer, load_text(e.data, part=e.part, text_field=e.text_field))


def held_out_perplexity(model, ids: torch.Tensor, recipe: Recipe, accelerator, windows: int | None) -> list[dict]:
    """Perplexity on the first ``windows`` windows; with more windows than the in-training count,
    also the in-training count's number (the same first windows, computed once)."""
    from ..eval.perplexity import perplexity

    e = recipe.eval
    n_avail = ids.numel() // e.seq_len
    n = n_avail if windows is None else min(windows, n_avail)
    short = min(e.windows, n)
    ctx = accelerator.autocast() if recipe.train.precision == "bf16" else nullcontext()
    parts = []
    with ctx:
        head = perplexity(model, ids[: short * e.seq_len], e.seq_len, batch_size=e.batch_size, progress=False,
                          inference_mode=not recipe.train.fsdp)
        parts.append(head)
        if n > short:
            parts.append(perplexity(model, ids[short * e.seq_len : n * e.seq_len], e.seq_len, batch_size=e.batch_size, progress=False,
                          inference_mode=not recipe.train.fsdp))
    rows = [{"windows": short, "tokens": head.tokens, "nll": head.nll, "perplexity": head.perplexity}]
    if len(parts) > 1:
        tokens = sum(p.tokens for p in parts)
        nll = sum(p.nll * p.tokens for p in parts) / tokens
        rows.append({"windows": n, "tokens": tokens, "nll": nll, "perplexity": math.exp(nll)})
    return rows


__all__ = ["held_out_ids", "held_out_perplexity"]
