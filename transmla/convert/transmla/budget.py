"""TransMLA cache shapes: R (latent d_c) and r (shared rope key d_r) from a budget, validated.

Cache per token per layer: R + r elements; the source's is 2*g*d. The published settings keep a
third of the budget as rope dims (SmolLM2: 128 + 64, 64 + 32, 32 + 16 for 50/25/12.5%); ours cap them
at half a head (DeepSeek-V2/V3 keep 64 rope dims of 128-dim heads): SmolLM2 at 50% is 160 + 32, which
beat 128 + 64 on the dev windows (benchmarks/calib_mix.py, the rope split round); 25% and 12.5% are
unchanged. The exportable shapes (one rope grid, shared_rope_budget) allow a whole head instead:
SmolLM2 at 50% is then 128 + 64, which kept retrieval at length better at the same dev perplexity
(benchmarks/results/retrieval_ladder.md).
"""

from __future__ import annotations

from ...messages import warn
from ..budget import budget_elements


def transmla_budget(source_kv_elements: int, fraction: float, head_dim: int, num_kv_heads: int) -> tuple[int, int]:
    """(R, r) for a cache of `fraction` of the source's: r = the largest whole number of pairs
    within a third of the budget and within half a head, R = the rest (capped at what the layer can use)."""
    budget = budget_elements(fraction, source_kv_elements)
    if budget < 3:
        raise ValueError(f"kv_budget {fraction} leaves {budget} cached elements per token; TransMLA needs at least 3")
    full = 2 * num_kv_heads * head_dim
    r = min(2 * (budget // 6), 2 * (head_dim // 4), num_kv_heads * head_dim)  # whole pairs: a third, at most half a head
    r = max(r, 2)
    R = min(budget - r, full - r)
    validate_transmla_shape(R, r, head_dim, num_kv_heads)
    return R, r


def shared_rope_budget(source_kv_elements: int, fraction: float, head_dim: int, num_kv_heads: int) -> tuple[int, int]:
    """(R, r) for the exportable shape (one rope grid in every layer, shared_rope_plan): r/2 pairs
    dividing head_dim/2, as many as fit a third of the budget, up to a whole head; R the rest.

    A whole head rather than transmla_budget's half (module docstring)."""
    R, r = transmla_budget(source_kv_elements, fraction, head_dim, num_kv_heads)  # validates the budget
    budget = R + r
    shared = max(min(2 * (budget // 6), head_dim), 2)
    while shared > 2 and (head_dim // 2) % (shared // 2):
        shared -= 2
    R = min(budget - shared, 2 * num_kv_heads * head_dim - shared)
    validate_transmla_shape(R, shared, head_dim, num_kv_heads)
    return R, shared


def validate_transmla_shape(kv_lora_rank: int, rope_dim: int, head_dim: int, num_kv_heads: int) -> None:
    """Errors for shapes TransMLA cannot build; a warning when the cache does not shrink."""
    keys = num_kv_heads * head_dim
    full = 2 * keys
    if rope_dim < 2 or rope_dim % 2:
        raise ValueError(f"rope_dim must cover whole rope pairs (a positive even number), got {rope_dim}")
    if rope_dim > keys:
        raise ValueError(
            f"rope_dim {rope_dim} does not fit: the keys have {keys} dims ({num_kv_heads} KV heads x {head_dim})"
        )
    if kv_lora_rank < 1:
        raise ValueError(f"kv_lora_rank must be positive, got {kv_lora_rank}")
    if kv_lora_rank > full - rope_dim:
        raise ValueError(
            f"kv_lora_rank {kv_lora_rank} is larger than the {full - rope_dim} dims it compresses "
            f"(2 * {num_kv_heads} KV heads * {head_dim} - rope dim {rope_dim})"
        )
    if kv_lora_rank + rope_dim >= full:
        warn(
            f"latent {kv_lora_rank} + rope {rope_dim} = {kv_lora_rank + rope_dim} cached elements per token per "
            f"layer: not smaller than the source's {full}; the cache does not shrink"
        )


__all__ = ["shared_rope_budget", "transmla_budget", "validate_transmla_shape"]
