"""The MHA2MLA conversion (Ji et al. 2025): partial-RoPE, then a low-rank latent for [K_nope; V].

Per layer (ALGORITHMS.md, MHA2MLA):
  replicate (exact)  ->  partial_rope (keep P pairs per key head; the rest lose RoPE)
  ->  compress_latent (joint or split SVD of [W_k,nope; W_v], weight-only or activation-aware).
Cache per token per layer: R + g*2P. Calibration statistics are collected only when the settings
read them (2norm selection reads the pair norms, activation weighting the input gram).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..families import attention_geometry
from .layers import MLALayer, SourceAttention
from .mha2mla_budget import MHA2MLAShape, resolve_shape
from .options import ConvertOptions
from .partial_rope import STRATEGIES, key_latent_dims, partial_rope, select_pairs
from .replicate import replicate
from .svd import SVD_MODES, WEIGHTINGS, compress_latent

# MHA2MLA as published scores pairs and whitens on the original model's activations.
DEFAULT_PROPAGATE = "original"
# Sequences x tokens. Many short sequences beat few long ones at equal tokens (each brings the
# attention-sink token every prompt has), as for TransMLA: on 32 dev windows 2048 x 16 beat 64 x 512
# (the ANCHORS.md protocol) by 19-27% at 50/25/12.5% of the cache (eval/results/mha2mla_calib_shape.md).
DEFAULT_CALIBRATION = (2048, 16)


@dataclass(frozen=True)
class MHA2MLASettings:
    shape: MHA2MLAShape
    rope_select: str = "high"
    svd: str = "joint"
    svd_weighting: str = "none"
    center: bool = False  # activation weighting only: centred covariance + mean through kv_b's bias

    def __post_init__(self) -> None:
        if self.rope_select not in STRATEGIES:
            raise ValueError(f"--rope-select must be one of {', '.join(STRATEGIES)}, got {self.rope_select!r}")
        if self.svd not in SVD_MODES:
            raise ValueError(f"--svd must be one of {', '.join(SVD_MODES)}, got {self.svd!r}")
        if self.svd_weighting not in WEIGHTINGS:
            raise ValueError(f"--svd-weighting must be one of {', '.join(WEIGHTINGS)}, got {self.svd_weighting!r}")

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


def settings_from_options(geometry, options: ConvertOptions, warn: bool = True) -> MHA2MLASettings:
    """Validate the CLI options that mha2mla reads; ValueError with one line for a bad setting."""
    if options.rope_dim is not None:
        raise ValueError("--rope-dim is a transmla option; mha2mla keeps --rope-pairs P pairs per key head")
    if str(options.freqfold) != ConvertOptions().freqfold:  # set away from its default
        raise ValueError("--freqfold is a transmla option; mha2mla keeps each pair's own frequency")
    if options.q_lora_rank is not None:
        raise ValueError("--q-lora-rank is not supported by mha2mla (the paper keeps the full query)")
    shape = resolve_shape(geometry, options.rope_pairs, options.kv_lora_rank, options.kv_budget, warn=warn)
    return MHA2MLASettings(shape, options.rope_select, options.svd, options.svd_weighting)


def mha2mla_layer(src: SourceAttention, settings: MHA2MLASettings, stats=None) -> tuple[MLALayer, dict]:
    """Convert one source layer. stats: calibrate.LayerStats (needed for 2norm / activation)."""
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
    out, factors = compress_latent(layer, k_dims, s.kv_lora_rank, settings.svd, gram, settings.center and gram is not None)
    info = {"pairs": pairs.tolist()}
    if factors.ranks is not None:
        info["rank_k"], info["rank_v"] = factors.ranks
    return out, info


def mha2mla_layers(
    source_dir: Path, config, options: ConvertOptions, progress: bool = True, *, calib_ids=None
) -> tuple[Iterator[MLALayer], dict]:
    """The converted layers (lazily, one at a time) and a description; meta["layers"] fills as they come.

    calib_ids [N, T] replaces the calibration text of the options (tests, benchmarks).
    """
    geo = attention_geometry(config)
    settings = settings_from_options(geo, options)
    meta = settings.describe()
    meta["layers"] = []  # per layer: kept pairs [g][P] (and the K/V rank split); filled lazily

    def convert(index: int, src: SourceAttention, stats=None) -> MLALayer:
        layer, info = mha2mla_layer(src, settings, stats)
        meta["layers"].append(info)
        return layer

    if not settings.needs_calibration:
        from .pipeline import source_layers

        layers = (convert(i, src) for i, src in enumerate(source_layers(source_dir, config)))
        return layers, meta

    from .calibrate import calibrated_layers

    propagate = options.propagate or DEFAULT_PROPAGATE
    if calib_ids is None:
        from transformers import AutoTokenizer

        from ..data.calib import calibration_chunks

        n, t = options.calibration_size(DEFAULT_CALIBRATION)
        meta["calibration"] = {
            "calib": options.calib, "samples": n, "seq_len": t, "seed": options.seed, "propagate": propagate,
        }
        tokenizer = AutoTokenizer.from_pretrained(source_dir)
        calib_ids = calibration_chunks(tokenizer, options.calib, n, t, options.seed)
    else:
        meta["calibration"] = {"ids": list(calib_ids.shape), "propagate": propagate}
    layers = calibrated_layers(
        source_dir, config, calib_ids, convert,
        propagate=propagate, pair_norms=settings.needs_pair_norms,
        device=options.resolved_device(), progress=progress,
    )
    return layers, meta


__all__ = ["MHA2MLASettings", "mha2mla_layer", "mha2mla_layers", "settings_from_options"]
