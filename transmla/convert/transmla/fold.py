"""FreqFold's fold F: the default rule (auto) and the folds the logit criterion tries (--freqfold).

ALGORITHMS.md, TransMLA 2: a fold group pools F adjacent frequencies of all KV heads (rorope.py).
"""

from __future__ import annotations


def auto_fold(head_dim: int, rope_dim: int) -> int:
    """--freqfold auto: F = d/r (a power of two, at least 1), so that there are as many fold groups
    (d/2F) as kept rope pairs (r/2): on average one rope component per group of F adjacent
    frequencies, each rotating at a frequency of its own block, as RoPE with d_r dims would.
    Measured best on held-out windows at 50/25/12.5% of SmolLM2's cache with score selection
    (benchmarks/results/transmla_bench.md), where the expected-logit-error criterion ("logit") chose
    F = 1 at every budget and lost at the two smaller ones."""
    f = 1
    while 2 * f * rope_dim <= head_dim:
        f *= 2
    return f


def fold_candidates(head_dim: int, num_pairs: int, rule: str, max_fold: int = 8) -> list[int]:
    """Folds to try for --freqfold logit: powers of two dividing d/2 (up to max_fold) that the
    selection rule can use with num_pairs rope pairs."""
    half = head_dim // 2
    out = []
    f = 1
    while f <= min(max_fold, half):
        fits = {"uniform": num_pairs % (half // f) == 0, "grid": half // f == num_pairs}.get(rule, True)
        if half % f == 0 and fits:
            out.append(f)
        f *= 2
    return out


__all__ = ["auto_fold", "fold_candidates"]
