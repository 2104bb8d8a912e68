"""The MHA2MLA conversion (Ji et al. 2025): partial-RoPE, then a low-rank latent for [K_nope; V].

Per layer (ALGORITHMS.md, MHA2MLA):
  replicate (exact)  ->  partial_rope (keep P pairs per key head; the rest lose RoPE)
  ->  compress_latent (joint or split SVD of [W_k,nope; W_v], weight-only or activation-aware).
Cache per token per layer: R + g*2P. Calibration statistics are collected only when the settings
read them (2norm selection reads the pair norms, activation weighting the input gram).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...families import AttentionGeometry
from ..layers import MLALayer, SourceAttention
from ..method import ConversionMethod, StatsNeeds
from ...schema import option
from ..budget import check_kv_budget
from ..replicate import replicate
from .budget import MHA2MLAShape, resolve_shape
from .partial_rope import STRATEGIES, key_latent_dims, partial_rope, select_pairs
from .svd import SVD_MODES, WEIGHTINGS, apply_factors, latent_spectrum, split_latent

# MHA2MLA as published scores pairs and whitens on the original model's activations.
DEFAULT_PROPAGATE = "original"
# Sequences x tokens. Many short sequences beat few long ones at equal tokens (each brings the
# attention-sink token every prompt has), as for TransMLA: on 32 dev windows 2048 x 16 beat 64 x 512
# (the ANCHORS.md protocol) by 19-27% at 50/25/12.5% of the cache (benchmarks/results/mha2mla_calib_shape.md).
DEFAULT_CALIBRATION = (2048, 16)


@dataclass(frozen=True)
class MHA2MLASettings:
    shape: MHA2MLAShape
    rope_select: str = "high"
    svd: str = "joint"
    svd_weighting: str = "activation"
    center: bool = False  # activation weighting only: centred covariance + mean through kv_b's bias

    def __post_init__(self) -> None:
        if self.rope_select not in STRATEGIES:
            raise ValueError(f"rope_select must be one of {', '.join(STRATEGIES)}, got {self.rope_select!r}")
        if self.svd not in SVD_MODES:
            raise ValueError(f"svd must be one of {', '.join(SVD_MODES)}, got {self.svd!r}")
        if self.svd_weighting not in WEIGHTINGS:
            raise ValueError(f"svd_weighting must be one of {', '.join(WEIGHTINGS)}, got {self.svd_weighting!r}")

    @property
    def needs_pair_norms(self) -> bool:
        return self.rope_select == "2norm"

    @property
    def needs_gram(self) -> bool:
        return self.svd_weighting == "activation"

    @property
    def needs_calibration(self) -> bool:
        return self.needs_pair_norms or self.needs_gram

    def describe(self) -> dict:
        s = self.shape
        return {
            "name": "mha2mla",
            "rope_pairs": s.rope_pairs,
            "kv_lora_rank": s.kv_lora_rank,
            "qk_rope_head_dim": s.rope_dim,
            "rope_select": self.rope_select,
            "svd": self.svd,
            "svd_weighting": self.svd_weighting,
            "svd_center": self.center,
            "kv_elements_per_token_per_layer": s.kv_elements,
        }


@dataclass
class MHA2MLAOptions:
    kv_lora_rank: int | None = option(None, "Latent size d_c.", short="-R")
    rope_pairs: int | None = option(None, "mha2mla: RoPE pairs kept per KV head (default: head_dim / 16).", short="-P")
    kv_budget: float | None = option(None, "Fraction of the source KV cache to keep; derives -R/-r (or -R with -P).")
    rope_select: str = option("high", "mha2mla: high | low | uniform | 2norm.")
    svd: str = option("joint", "mha2mla: joint | split low rank of [K_nope; V].")
    svd_weighting: str = option(
        "activation", "mha2mla: activation (whiten by the calibration input covariance; far better "
        "training-free) | none (weight-only SVD, as published)."
    )

    def __post_init__(self) -> None:
        check_kv_budget(self.kv_budget)


def settings_from_options(geometry: AttentionGeometry, options: MHA2MLAOptions, warn: bool = True) -> MHA2MLASettings:
    """Validate the settings mha2mla reads; ValueError with one line for a bad setting."""
    shape = resolve_shape(geometry, options.rope_pairs, options.kv_lora_rank, options.kv_budget, warn=warn)
    return MHA2MLASettings(shape, options.rope_select, options.svd, options.svd_weighting)


def mha2mla_layer(src: SourceAttention, settings: MHA2MLASettings, stats=None) -> tuple[MLALayer, dict]:
    """Convert one source layer. stats: calibrate.LayerStats (needed for 2norm / activation)."""
    return mha2mla_layer_at_ranks(src, settings, stats, [settings.shape.kv_lora_rank])[0]


def mha2mla_layer_at_ranks(src: SourceAttention, settings: MHA2MLASettings, stats, ranks) -> list[tuple[MLALayer, dict]]:
    """Convert one source layer at several latent ranks R from one decomposition: the pair selection,
    partial RoPE and SVD are done once, then truncated to each rank (svd.latent_spectrum). Result i is
    mha2mla_layer with kv_lora_rank ranks[i] (settings.shape's own rank is not read)."""
    geo = src.geometry
    s = settings.shape
    if settings.needs_calibration and stats is None:
        raise ValueError("this mha2mla setting needs calibration statistics")
    pairs = select_pairs(
        settings.rope_select, geo.num_kv_heads, geo.head_dim, s.rope_pairs,
        q_pair_norm=None if stats is None else stats.q_pair_norm,
        k_pair_norm=None if stats is None else stats.k_pair_norm,
    )  # [g, P]
    layer = partial_rope(replicate(src), pairs, geo.num_heads, geo.head_dim)
    gram = stats.gram if settings.needs_gram else None
    k_dims = key_latent_dims(geo.num_kv_heads, geo.head_dim, s.rope_pairs)
    w, b = split_latent(layer)
    spectrum = latent_spectrum(w, b, k_dims, settings.svd, gram, settings.center and gram is not None)
    out = []
    for rank in ranks:
        factors = spectrum.truncate(rank)
        info = {"pairs": pairs.tolist()}
        if factors.ranks is not None:
            info["rank_k"], info["rank_v"] = factors.ranks
        out.append((apply_factors(layer, factors), info))
    return out


class MHA2MLA(ConversionMethod):
    name = "mha2mla"
    help = "partial-RoPE selection, then an activation-aware or weight SVD"
    Options = MHA2MLAOptions
    default_calibration = DEFAULT_CALIBRATION
    default_propagate = DEFAULT_PROPAGATE

    def plan(self, geometry: AttentionGeometry, options: MHA2MLAOptions) -> MHA2MLASettings:
        return settings_from_options(geometry, options)

    def cache_elements(self, plan: MHA2MLASettings) -> int:
        return plan.shape.kv_elements

    def needs(self, plan: MHA2MLASettings) -> StatsNeeds:
        return StatsNeeds(gram=plan.needs_gram, pair_norms=plan.needs_pair_norms)

    def describe(self, plan: MHA2MLASettings) -> dict:
        return plan.describe()

    def shared_rope(self, geometry: AttentionGeometry, options: MHA2MLAOptions) -> MHA2MLAOptions:
        if geometry.num_kv_heads > 1 or options.rope_select not in ("high", "uniform"):
            raise ValueError(
                "shared_rope: mha2mla keeps each KV head's own rope pairs; only a single-KV-head source with "
                "rope_select high or uniform shares one grid; use method transmla"
            )
        return options

    def convert_layer(self, plan: MHA2MLASettings, source: SourceAttention, stats) -> tuple[MLALayer, dict]:
        return mha2mla_layer(source, plan, stats)

    def convert_layer_at_ranks(self, plan: MHA2MLASettings, source: SourceAttention, stats,
                               ranks) -> list[tuple[MLALayer, dict]]:
        """convert_layer at each latent rank in `ranks` (plan's other settings), sharing one SVD:
        what a sweep over budgets with a fixed P needs (benchmarks/mha2mla_bench.py)."""
        return mha2mla_layer_at_ranks(source, plan, stats, ranks)


__all__ = ["MHA2MLA", "MHA2MLAOptions", "MHA2MLASettings", "mha2mla_layer", "mha2mla_layer_at_ranks", "settings_from_options"]
