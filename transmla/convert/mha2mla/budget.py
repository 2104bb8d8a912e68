"""MHA2MLA cache shape: R latent dims + g*2P rope dims per token per layer, checked before any work.

The source caches 2*g*d elements per token per layer (K and V of g key heads). MHA2MLA caches the
latent (R = kv_lora_rank) and the kept rope pairs of every key head (P = rope_pairs per head,
2 dims each): R + g*2P. kv_budget FRACTION fixes the total and derives R for the given P.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...families import AttentionGeometry
from ...messages import warn as warn_user
from ..budget import budget_elements

PUBLISHED_PAIRS_PER_HEAD_DIM = 16  # the paper keeps P = d/16 pairs (4 for d = 64, 8 for d = 128)


def default_rope_pairs(head_dim: int) -> int:
    """The published default: d/16 pairs per key head (at least one)."""
    return max(1, head_dim // PUBLISHED_PAIRS_PER_HEAD_DIM)


def mha2mla_budget(source_kv_elements: int, fraction: float, num_kv_heads: int, rope_pairs: int) -> int:
    """The latent rank R that makes R + g*2P at most `fraction` of the source cache.

    R = floor(fraction * source) - g*2P. Raises ValueError when nothing is left for the latent.
    """
    total = budget_elements(fraction, source_kv_elements)
    rope = num_kv_heads * 2 * rope_pairs
    rank = total - rope
    if rank < 1:
        raise ValueError(
            f"kv_budget {fraction:g} gives {total} cached elements per token per layer, but "
            f"{rope_pairs} rope pairs x {num_kv_heads} key heads already take {rope}; "
            f"lower rope_pairs or raise the budget"
        )
    return rank


@dataclass(frozen=True)
class MHA2MLAShape:
    rope_pairs: int  # P per key head
    kv_lora_rank: int  # R
    num_kv_heads: int  # g
    head_dim: int  # d

    @property
    def rope_dim(self) -> int:
        return self.num_kv_heads * 2 * self.rope_pairs

    @property
    def full_latent(self) -> int:
        """[K_nope; V] before truncation: g*(d - 2P) + g*d = 2*g*d - g*2P."""
        return 2 * self.num_kv_heads * self.head_dim - self.rope_dim

    @property
    def kv_elements(self) -> int:
        return self.kv_lora_rank + self.rope_dim


def resolve_shape(
    geometry: AttentionGeometry,
    rope_pairs: int | None,
    kv_lora_rank: int | None,
    kv_budget: float | None,
    warn: bool = True,
) -> MHA2MLAShape:
    """Validate rope_pairs / kv_lora_rank / kv_budget for a source geometry; one-line errors."""
    g, d = geometry.num_kv_heads, geometry.head_dim
    half = d // 2
    P = default_rope_pairs(d) if rope_pairs is None else rope_pairs
    if isinstance(P, bool) or not isinstance(P, int) or not 0 <= P <= half:
        raise ValueError(f"rope_pairs must be a whole number of pairs in 0..{half} (head_dim {d}), got {rope_pairs!r}")
    if kv_lora_rank is not None and kv_budget is not None:
        raise ValueError("give either kv_lora_rank or kv_budget, not both")
    source = geometry.kv_elements_per_token_per_layer
    if kv_lora_rank is None and kv_budget is None:
        raise ValueError("mha2mla needs the latent size: give kv_lora_rank R or kv_budget FRACTION")
    if kv_budget is not None:
        R = mha2mla_budget(source, kv_budget, g, P)
    else:
        R = kv_lora_rank
    shape = MHA2MLAShape(rope_pairs=P, kv_lora_rank=R, num_kv_heads=g, head_dim=d)
    if isinstance(R, bool) or not isinstance(R, int) or not 1 <= R <= shape.full_latent:
        raise ValueError(
            f"kv_lora_rank must be in 1..{shape.full_latent} (2*g*d - g*2P = 2*{g}*{d} - {g}*{2 * P}), got {R!r}"
        )
    if warn and shape.kv_elements >= source:
        warn_user(
            f"mha2mla with R={R} and {P} rope pairs per head caches {shape.kv_elements} elements per token "
            f"per layer, not less than the source's {source}: the cache does not shrink"
        )
    return shape
