"""The TransMLA method: RoRoPE, FreqFold and BKV-PCA, calibrated one layer at a time.

Per layer (ALGORITHMS.md, TransMLA): from the layer's calibration gram G = E[[x;1][x;1]^T],
1. RoRoPE / FreqFold: PCA of the key pairs across KV heads (per fold group of F frequencies),
   the same rotation on keys and slot-placed queries; r/2 components stay rope pairs, the rest
   become NoPE (rorope.py);
2. BKV balance and the joint PCA of [K_nope/alpha; V] at rank R (bkv.py);
3. optionally a low-rank query (PCA, rank Q).
Everything is a second moment of a linear map of x, so G is all a layer needs: the calibration
holds one layer's weights and the calibration tokens' hidden states, never every layer's
activations (calibrate.calibrated_layers).

`TransMLAPlan` holds every choice. `published_plan` is the published algorithm; `default_plan`
is ours (see benchmarks/results/transmla_bench.md for the measurements behind each default).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace

import torch

from ...families import AttentionGeometry
from ...progress import stderr_console
from ..layers import MLALayer, SourceAttention
from ..lowrank import with_bias_column
from ..method import ConversionMethod, StatsNeeds
from ...schema import option
from ..budget import budget_elements, check_kv_budget
from .bkv import assemble_layer, attention_metric, identity_latent, joint_pca
from .budget import shared_rope_budget, transmla_budget, validate_transmla_shape
from .fold import auto_fold, fold_candidates
from .rorope import (
    ROTATIONS,
    check_fold,
    component_scores,
    kept_frequencies,
    logit_error,
    nope_scales,
    pair_second_moment,
    query_pair_moment,
    rorope,
    select_components,
    split_rope,
)

DEFAULT_PROPAGATE = "original"
# Sequences x tokens: many short sequences (each starts with the attention-sink token every prompt
# has) beat few long ones at equal tokens, measured from 64 x 512 to 4096 x 8; best: 2048 x 16
# (benchmarks/results/transmla_bench.md, dev32).
DEFAULT_CALIBRATION = (2048, 16)
FOLD_RULES = ("auto", "logit")
# The CLI's rotation ("auto") is the unitary one for a cache of at most this share of the source's: chosen there
# by the 25% rule written before measuring (benchmarks/results/retrieval_ladder.md, cli-25-unitary+fit against
# cli-25+fit-rel200-q256: more dev keys, dev recall and dev32 within the rule); real above (at 50%,
# rope-64-unitary+fit lost dev recall against the real rotation's conversion: rejected by its rule).
UNITARY_MAX_BUDGET = 0.25
# The output-aware fit after each layer's conversion (output_fit.py), chosen on dev32
# (benchmarks/results/output_fit.md).
DEFAULT_FIT_STEPS = 200


@dataclass
class TransMLAPlan:
    """Every choice of one TransMLA conversion (the same for all layers unless a rule picks per layer)."""

    kv_lora_rank: int  # R = d_c
    rope_dim: int  # r = d_r (whole pairs)
    freqfold: int | str = "auto"  # F; "auto": F = d/r (fold.auto_fold); "logit": per layer, least expected logit error
    selection: str = "score"  # score (ours: top components by expected score change) | uniform (published)
    frequencies: str = "published"  # published | weighted (frequency of a folded component)
    nope_scale: bool = False  # scale each NoPE'd pair by E cos(w Delta) (least squares) instead of 1
    # RoRoPE's rotation across KV heads (rorope.py): real (published) | unitary (complex, keeps more key energy in rope)
    rotation: str = "real"
    balance: bool = True  # BKV
    centre: bool = False  # PCA of the covariance (means restored exactly) instead of the second moment
    # PCA metric (bkv.py): activation (the published plain PCA of [K_nope; V]; the best with our
    # calibration) | output (V errors weighted by W_o) | attention (K errors by the queries too)
    pca_metric: str = "activation"
    q_lora_rank: int | None = None
    context: int = 512  # relative distances the logit criterion averages over
    max_fold: int = 8  # largest F tried by "logit"

    def __post_init__(self) -> None:
        if self.rotation not in ROTATIONS:
            raise ValueError(f"rotation must be one of {', '.join(ROTATIONS)}, got {self.rotation!r}")

    def to_dict(self) -> dict:
        return asdict(self)


def published_plan(kv_lora_rank: int, rope_dim: int, freqfold: int) -> TransMLAPlan:
    """TransMLA as published: uniform per-group selection, published frequencies, plain NoPE, BKV,
    uncentred PCA, a fixed F (the public scripts pick it by test perplexity)."""
    return TransMLAPlan(
        kv_lora_rank, rope_dim, freqfold=freqfold, selection="uniform", frequencies="published", pca_metric="activation"
    )


def default_plan(kv_lora_rank: int, rope_dim: int, freqfold: int | str = "auto", q_lora_rank: int | None = None) -> TransMLAPlan:
    """Our defaults, chosen by measurement (benchmarks/results/transmla_bench.md): score selection of the
    rope components, F = d/r, the published plain PCA, with DEFAULT_CALIBRATION and
    DEFAULT_PROPAGATE (2048 x 16 tokens, calibrated on the original model)."""
    return TransMLAPlan(kv_lora_rank, rope_dim, freqfold=freqfold, q_lora_rank=q_lora_rank)


def shared_rope_plan(plan: TransMLAPlan, head_dim: int) -> TransMLAPlan:
    """shared_rope: one rope grid in every layer (exportable to DeepSeek engines and llama.cpp).

    FreqFold with F = d/r keeps one component per fold group (the best by score) at the group's
    first frequency w_(aF) = theta^(-2a/r): DeepSeek's theta^(-2i/d_r) grid, the same in all layers.
    """
    pairs = plan.rope_dim // 2
    if pairs == 0 or (head_dim // 2) % pairs:
        raise ValueError(f"the shared rope grid (the default) needs rope dims r with (head_dim/2) / (r/2) whole; got r = "
                         f"{plan.rope_dim}, head_dim {head_dim}: choose such an r, or convert with --per-layer-rope")
    fold = head_dim // plan.rope_dim
    if plan.freqfold not in ("auto", fold):
        raise ValueError(f"the shared rope grid (the default) fixes freqfold to head_dim / rope_dim = {fold}; got freqfold "
                         f"{plan.freqfold}: leave freqfold out, or convert with --per-layer-rope")
    return replace(plan, selection="grid", freqfold=fold, frequencies="published")


# --------------------------------------------------------------------------------------------
# One layer
# --------------------------------------------------------------------------------------------


@dataclass
class LayerMoments:
    """The second moments one layer's conversion needs, all from the gram."""

    gram: torch.Tensor  # [D+1, D+1]
    key: torch.Tensor  # [g*d, g*d] E[k k^T]
    query: torch.Tensor  # [g, d, d] per group: sum over its query heads of E[q_h q_h^T]
    logit_energy: float | None = None  # source_logit_energy, once computed

    @classmethod
    def of(cls, src: SourceAttention, gram: torch.Tensor) -> "LayerMoments":
        geo = src.geometry
        g = gram.double()
        wk = with_bias_column(src.wk, src.bk, torch.float64)
        wq = with_bias_column(src.wq, src.bq, torch.float64).view(geo.num_heads, geo.head_dim, -1)  # [H, d, D+1]
        key = wk @ g @ wk.T
        q = torch.einsum("hdx,xy,hey->hde", wq, g, wq)  # [H, d, d]
        query = q.view(geo.num_kv_heads, geo.group_size, geo.head_dim, geo.head_dim).sum(1)
        return cls(gram=g, key=key, query=query)


@dataclass
class RopeChoice:
    fold: int
    kept: torch.Tensor
    inv_freq: torch.Tensor
    nope_scale: torch.Tensor | None
    rotation: object
    logit_error: float  # relative expected squared logit error (0 = exact)


def _rope_choice(src: SourceAttention, m: LayerMoments, plan: TransMLAPlan, fold: int) -> RopeChoice:
    geo = src.geometry
    g, d = geo.num_kv_heads, geo.head_dim
    rot = rorope(pair_second_moment(m.key, g, d, hermitian=plan.rotation == "unitary"), g, d, fold)
    num_pairs = plan.rope_dim // 2
    scores = None
    if plan.selection in ("score", "grid"):
        scores = component_scores(rot, query_pair_moment(m.query, g, d), src.inv_freq, plan.context)
    kept = select_components(rot, num_pairs, plan.selection, scores)
    freqs = kept_frequencies(rot, kept, src.inv_freq, plan.frequencies)
    scale = nope_scales(rot, src.inv_freq, plan.context) if plan.nope_scale else None
    err = logit_error(rot, kept, freqs, src.inv_freq, m.key, m.query, plan.context, scale)
    total = source_logit_energy(src, m, plan.context)
    return RopeChoice(fold, kept, freqs, scale, rot, err / total if total > 0 else 0.0)


def source_logit_energy(src: SourceAttention, m: "LayerMoments", context: int) -> float:
    """E[logit^2] of the source (rorope.logit_error against an all-zero conversion, pairs grouped
    one frequency at a time): the scale that makes the logit error relative. Cached on m."""
    if m.logit_energy is None:
        g, d = src.geometry.num_kv_heads, src.geometry.head_dim
        rot = rorope(pair_second_moment(m.key, g, d), g, d, 1)
        none = torch.zeros(0, dtype=torch.long)
        zero = torch.zeros(g * d // 2, dtype=torch.float64)
        m.logit_energy = logit_error(rot, none, torch.zeros(0), src.inv_freq, m.key, m.query, context, zero)
    return m.logit_energy


def choose_rope(src: SourceAttention, m: LayerMoments, plan: TransMLAPlan) -> tuple[RopeChoice, dict[int, float]]:
    """The RoRoPE/FreqFold choice for one layer: freqfold F, "auto" (F = d/r, fold.auto_fold) or
    "logit" (the fold among fold_candidates with the smallest expected logit error,
    rorope.logit_error). Returns the choice and every tried fold's relative error."""
    d = src.geometry.head_dim
    if plan.freqfold == "auto":
        folds = [auto_fold(d, plan.rope_dim)]
    elif plan.freqfold == "logit":
        folds = fold_candidates(d, plan.rope_dim // 2, plan.selection, plan.max_fold)
        if not folds:
            raise ValueError(f"no freqfold fits {plan.rope_dim // 2} rope pairs with {plan.selection} selection")
    else:
        folds = [int(plan.freqfold)]
    choices = [_rope_choice(src, m, plan, f) for f in folds]
    best = min(choices, key=lambda c: c.logit_error)
    return best, {c.fold: c.logit_error for c in choices}


def augmented_maps(src: SourceAttention) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The query, key and value maps as [W | b] in float64 ([out, D+1], acting on [x; 1])."""
    return tuple(with_bias_column(w, b, torch.float64) for w, b in ((src.wq, src.bq), (src.wk, src.bk), (src.wv, src.bv)))


def convert_layer(src: SourceAttention, gram: torch.Tensor, plan: TransMLAPlan,
                  rope_gram: torch.Tensor | None = None) -> tuple[MLALayer, dict]:
    """One source layer -> (MLA layer, info).

    gram: E[[x;1][x;1]^T] of the layer's input. rope_gram: a different gram for the RoRoPE step
    (the published code calibrates RoRoPE on the original model and the PCA on the partial-RoPE
    model); default: the same.
    """
    geo = src.geometry
    m = LayerMoments.of(src, gram if rope_gram is None else rope_gram)
    choice, tried = choose_rope(src, m, plan)
    wq, wk, wv = augmented_maps(src)
    partial = split_rope(wq, wk, geo.num_heads, choice.rotation, choice.kept, choice.inv_freq, choice.nope_scale)
    metric = None
    if plan.pca_metric in ("attention", "output"):
        pca_m = m if rope_gram is None else LayerMoments.of(src, gram)
        query = pca_m.query if plan.pca_metric == "attention" else None
        metric = attention_metric(partial.nope_to_head, query, src.wo, geo.num_heads)
    elif plan.pca_metric != "activation":
        raise ValueError(f"pca_metric must be 'activation', 'attention' or 'output', got {plan.pca_metric!r}")
    latent = joint_pca(
        partial.k_nope, wv, gram, plan.kv_lora_rank, balance=plan.balance, centre=plan.centre, metric=metric
    )
    layer = assemble_layer(
        wq, src.wo, src.bo, partial, latent, geo.num_heads, q_bias=src.bq is not None,
        kv_bias=src.bk is not None or src.bv is not None or plan.centre, q_lora_rank=plan.q_lora_rank, gram=gram,
    )
    info = {
        "freqfold": choice.fold,
        "logit_error": choice.logit_error,
        "logit_error_by_fold": tried,
        "alpha": latent.alpha,
        "pca_energy_kept": latent.kept_energy(),
    }
    return layer, info


def stage_layers(src: SourceAttention, gram: torch.Tensor, plan: TransMLAPlan) -> dict[str, MLALayer]:
    """The layer after each stage (for --eval-data): "rorope" (smallest usable fold, full-rank
    latent), "freqfold" (the chosen fold, full-rank latent) and "bkv_pca" (the result)."""
    geo = src.geometry
    m = LayerMoments.of(src, gram)
    wq, wk, wv = augmented_maps(src)
    folds = fold_candidates(geo.head_dim, plan.rope_dim // 2, plan.selection, geo.head_dim // 2)
    out = {}
    for name, p in (("rorope", replace(plan, freqfold=folds[0]) if folds else plan), ("freqfold", plan)):
        c = choose_rope(src, m, p)[0]
        part = split_rope(wq, wk, geo.num_heads, c.rotation, c.kept, c.inv_freq, c.nope_scale)
        out[name] = assemble_layer(
            wq, src.wo, src.bo, part, identity_latent(part.k_nope, wv), geo.num_heads,
            q_bias=src.bq is not None, kv_bias=src.bk is not None or src.bv is not None,
        )
    out["bkv_pca"] = convert_layer(src, gram, plan)[0]
    return out


# --------------------------------------------------------------------------------------------
# The method (CLI --method transmla)
# --------------------------------------------------------------------------------------------


@dataclass
class TransMLAOptions:
    kv_lora_rank: int | None = option(None, "Latent size d_c.", short="-R")
    rope_dim: int | None = option(None, "transmla: shared rope key dims d_r.", short="-r")
    kv_budget: float | None = option(None, "Fraction of the source KV cache to keep; derives -R/-r (or -R with -P).")
    freqfold: str = option(
        "auto", "transmla: frequencies folded per PCA group: an integer, 'auto' (F = head_dim / rope-dim) or "
        "'logit' (per layer, least expected logit error)."
    )
    q_lora_rank: int | None = option(None, "transmla: low-rank query of this rank (PCA).")
    # The default is the exportable shape (issue 35): on wiki-test 32 it costs 2.9% / 3.4% / 13% in
    # perplexity at 50% / 25% / 12.5% of the cache against per-layer rope (benchmarks/results/
    # output_fit.md, "cli" rows), but every engine export refuses per-layer frequencies, and on dev
    # passkeys the exportable 50% retrieves better (benchmarks/results/retrieval_ladder.md).
    shared_rope: bool = option(
        True, "transmla: --shared-rope (default): one rope frequency grid in every layer (one component per "
        "FreqFold group, F = head_dim / rope-dim), the shape `transmla export` writes for DeepSeek engines and "
        "llama.cpp; --per-layer-rope: each layer keeps its own best rope frequencies (a little lower perplexity, "
        "our own format only: export refuses it).",
        flag="--shared-rope/--per-layer-rope",
    )

    rotation: str = option(
        "auto", "transmla: RoRoPE's rotation across the KV heads of each frequency: 'real' (published), 'unitary' "
        "(a complex PCA: as exact, keeps more of the keys' energy under RoPE; benchmarks/results/rope_energy.md) or "
        "'auto' (unitary where it was chosen: several KV heads and a cache of at most 25% of the source's; else real)."
    )

    def __post_init__(self) -> None:
        check_kv_budget(self.kv_budget)
        self.rotation = str(self.rotation).strip().lower()
        if self.rotation not in (*ROTATIONS, "auto"):
            raise ValueError(f"rotation must be one of {', '.join(ROTATIONS)} or auto, got {self.rotation!r}")


def resolve_shape(options: TransMLAOptions, geo: AttentionGeometry) -> tuple[int, int]:
    """(R, r) from kv_budget or kv_lora_rank/rope_dim, validated."""
    source = geo.kv_elements_per_token_per_layer
    if options.kv_budget is not None:
        if options.kv_lora_rank is not None or options.rope_dim is not None:
            raise ValueError("give either kv_budget or kv_lora_rank/rope_dim, not both")
        budget = shared_rope_budget if options.shared_rope else transmla_budget
        R, r = budget(source, options.kv_budget, geo.head_dim, geo.num_kv_heads)
    else:
        if options.kv_lora_rank is None or options.rope_dim is None:
            raise ValueError("transmla needs kv_lora_rank and rope_dim, or kv_budget")
        R, r = options.kv_lora_rank, options.rope_dim
    validate_transmla_shape(R, r, geo.head_dim, geo.num_kv_heads)
    return R, r


def plan_from_options(options: TransMLAOptions, geo: AttentionGeometry) -> TransMLAPlan:
    R, r = resolve_shape(options, geo)
    fold: int | str = str(options.freqfold).strip().lower()
    if fold not in FOLD_RULES:
        try:
            fold = int(fold)
        except ValueError:
            raise ValueError(f"freqfold must be an integer, 'auto' or 'logit', got {options.freqfold!r}") from None
        check_fold(fold, geo.head_dim)
    if options.q_lora_rank is not None:
        q_out = geo.num_heads * (geo.head_dim + r)
        if not 1 <= options.q_lora_rank <= min(q_out, geo.hidden_size):
            raise ValueError(f"q_lora_rank must be between 1 and {min(q_out, geo.hidden_size)}, got {options.q_lora_rank}")
    rotation = options.rotation
    if rotation == "auto":
        # one KV head: nothing to rotate across (at F > 1 a complex basis would only mix frequencies, unmeasured)
        unitary = geo.num_kv_heads > 1 and R + r <= budget_elements(UNITARY_MAX_BUDGET, geo.kv_elements_per_token_per_layer)
        rotation = "unitary" if unitary else "real"
    plan = replace(default_plan(R, r, fold, options.q_lora_rank), rotation=rotation)
    return shared_rope_plan(plan, geo.head_dim) if options.shared_rope else plan


@contextmanager
def _one_thread():
    """Small float64 eigen-problems: a thread pool only adds waiting."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class TransMLA(ConversionMethod):
    name = "transmla"
    help = "RoRoPE, FreqFold, BKV-PCA; for GQA sources"
    Options = TransMLAOptions
    default_calibration = DEFAULT_CALIBRATION
    default_propagate = DEFAULT_PROPAGATE
    default_fit_steps = DEFAULT_FIT_STEPS

    def plan(self, geometry: AttentionGeometry, options: TransMLAOptions) -> TransMLAPlan:
        return plan_from_options(options, geometry)

    def shared_rope(self, geometry: AttentionGeometry, options: TransMLAOptions) -> TransMLAOptions:
        if not options.shared_rope:
            raise ValueError("format deepseek needs one rope grid shared by all layers; this conversion asks for "
                             "per-layer rope frequencies")
        return options

    def needs(self, plan: TransMLAPlan) -> StatsNeeds:
        return StatsNeeds(gram=True)

    def cache_elements(self, plan: TransMLAPlan) -> int:
        return plan.kv_lora_rank + plan.rope_dim

    def describe(self, plan: TransMLAPlan) -> dict:
        return {"kv_lora_rank": plan.kv_lora_rank, "rope_dim": plan.rope_dim, "plan": plan.to_dict()}

    def convert_layer(self, plan: TransMLAPlan, source: SourceAttention, stats) -> tuple[MLALayer, dict]:
        with _one_thread():
            layer, info = convert_layer(source, stats.gram, plan)
        return layer, {k: v for k, v in info.items() if k != "logit_error_by_fold"}

    def stage_layers(self, plan: TransMLAPlan, source: SourceAttention, stats) -> dict[str, MLALayer]:
        with _one_thread():
            return stage_layers(source, stats.gram, plan)

    def summarize(self, geometry: AttentionGeometry, plan: TransMLAPlan, infos: list[dict], seconds: float) -> None:
        print_kv_summary(geometry, plan, infos, seconds)


def print_kv_summary(geo, plan: TransMLAPlan, per_layer: list[dict], seconds: float | None = None) -> None:
    src = geo.kv_elements_per_token_per_layer
    new = plan.kv_lora_rank + plan.rope_dim
    folds = sorted({p["freqfold"] for p in per_layer})
    err = sum(p["logit_error"] for p in per_layer) / max(len(per_layer), 1)
    energy = sum(p["pca_energy_kept"] for p in per_layer) / max(len(per_layer), 1)
    stderr_console.print(
        f"[bold]KV cache[/]: {src} -> {new} elements per token per layer "
        f"({new / src:.1%}; latent {plan.kv_lora_rank} + rope {plan.rope_dim}); "
        f"{src * geo.num_layers * 2:,} -> {new * geo.num_layers * 2:,} bytes per token in bf16 over {geo.num_layers} layers"
    )
    stderr_console.print(
        f"freqfold per layer {folds}; mean relative logit error {err:.3g}; mean PCA energy kept {energy:.3f}"
        + (f"; {seconds:.1f} s" if seconds is not None else "")
    )


__all__ = [
    "DEFAULT_CALIBRATION",
    "DEFAULT_PROPAGATE",
    "LayerMoments",
    "TransMLA",
    "TransMLAOptions",
    "TransMLAPlan",
    "choose_rope",
    "convert_layer",
    "default_plan",
    "plan_from_options",
    "published_plan",
    "resolve_shape",
    "shared_rope_plan",
    "stage_layers",
]

