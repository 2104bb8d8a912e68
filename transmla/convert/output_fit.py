"""Output-aware fit: after a method converts a layer, fit its MLA projections so the layer's
attention output matches the source's on calibration activations (issue 18).

The methods fit second moments of keys and values (K/V reconstruction); what the model computes
is the attention output. Per layer, with X [N, T, D] the attention input of the fit sequences
(after the layer's input norm) and Z = Attn_src(X) the source attention's output:

1. o_proj in closed form: with Y [n, H*d_v] the MLA heads' outputs before o_proj (n = N*T tokens),
   ridge least squares toward the converted W0:  W^T = (Y^T Y + lam I)^-1 (Y^T Z + lam W0^T),
   lam = RIDGE * mean(diag(Y^T Y)) (normal equations of ||Y W^T - Z||^2 + lam ||W - W0||^2);
2. every projection (query, kv_a, the latent norm, kv_b, o_proj and their biases; the rope
   frequencies fixed) by `steps` Adam steps on ||Attn_mla(X) - Z||^2 / ||Z||^2 over random
   minibatches of about FitSettings.minibatch_tokens tokens; their forward and backward passes run
   under bf16 autocast where bf16 products pay (the CLI's choice, dtypes.fast_bf16_matmul: GPUs, AMX CPUs and
   AVX-512 BF16 CPUs where a probe finds bf16 faster; the same dev perplexity as fp32, benchmarks/results/output_fit.md and fit_cost.md);
   At a quarter of the cache or less the CLI's Adam takes RELATIVE_FIT: each tensor's rate in units of its
   own RMS, warmup and a cosine decay, the loss on 256 sampled query positions per sequence;
3. o_proj in closed form again (the optimum for the other projections as fitted).
Of the method's layer, the layer after step 1 and the layer after step 3, the one with the lowest
error on the fit sequences is kept. Adam's learning rate can make a layer worse where the
weights are on another scale: on Qwen2.5-Coder-1.5B at 25% steps 2-3 at 3e-3 raised the error in 22 of
28 layers. So a run whose loss rises restarts at a third of the rate (adam_fit), and a layer that is
still worse falls back to the best earlier candidate. Adam starts at 1e-3: with the fit on 64 x 1024
tokens no layer of the built-in model's conversions (25% and 50%) kept 3e-3; each ran 50 steps at 3e-3,
failed the check and restarted at 1e-3 from the same weights and seed, so starting there gives the same
layers without those steps.

The shapes never change, so the fitted layer exports as the unfitted one would. Measured on the
built-in model: benchmarks/results/output_fit.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..mla.attention import MLAAttention
from .budget import budget_elements
from .calibrate import mla_attention
from .layers import MLALayer

RIDGE = 1e-3
MINIBATCH_TOKENS = 2048
DIVERGENCE_WINDOW = 10  # Adam steps averaged by the divergence check (adam_fit)
BACKOFF = 3.0  # the learning rate's divisor after a divergence
MAX_BACKOFFS = 1
# A candidate layer replaces the best so far only when its relative error is lower by more than this: the
# errors come from float64 sums whose cancellation (and the fp32 outputs) leave noise far below it, and an
# exact layer must stay exactly as it is.
ERROR_NOISE = 1e-9
SCHEDULES = ("constant", "cosine")
LR_FLOOR = 0.05  # the cosine schedule's last factor
RELATIVE_FLOOR = 1e-2
# 64 sequences x 1024 tokens: the same tokens as the earlier 1024 x 64, but the fit sees attention over
# distances up to 1024, which retrieval at length needs: chosen over 128 x 512 and 1024 x 64 on dev passkey
# keys and dev32 perplexity by the rule written before measuring (benchmarks/results/retrieval_ladder.md,
# rope-64+fit-1024), for a longer fit. 1024 x 64 had beaten 256 x 64 (benchmarks/results/output_fit.md).
# The attention-sink token starts every sequence.
DEFAULT_FIT_CALIBRATION = (64, 1024)
# Sources wider than WIDE_FIT_HIDDEN, converted to at most WIDE_FIT_MAX_BUDGET of their cache, fit on WIDE_FIT_SAMPLES
# sequences (issue 36): chosen by the rule written before measuring (benchmarks/qwen2_1p5b.py,
# transmla-0.25-cli-fit128) on the 1.5B's own dev windows at 25%, whose layers have 2.7x the built-in model's width;
# the built-in model's dev measures stayed flat at 128 for 1.4x the time (benchmarks/results/retrieval_ladder.md,
# cli-25-unitary+fit-seq128), so it keeps 64. Larger budgets keep 64 until a run of their own passes there.
WIDE_FIT_HIDDEN = 1024
WIDE_FIT_SAMPLES = 128
WIDE_FIT_MAX_BUDGET = 0.25


def default_fit_samples(hidden_size: int, cache_elements: int | None, source_elements: int) -> int:
    """The output fit's sequence count for a source of this hidden size whose cache per token and layer goes from
    source_elements to cache_elements (None: unknown), before a short text halves it."""
    quarter = cache_elements is not None and cache_elements <= budget_elements(WIDE_FIT_MAX_BUDGET, source_elements)
    return WIDE_FIT_SAMPLES if hidden_size > WIDE_FIT_HIDDEN and quarter else DEFAULT_FIT_CALIBRATION[0]


@dataclass(frozen=True)
class FitSettings:
    steps: int  # Adam steps per layer (0: the closed-form o_proj only); the default is the method's (default_fit_steps)
    lr: float = 1e-3
    bf16: bool = False  # Adam's forward and backward under bf16 autocast (fp32 weights and loss)
    # The closed forms' attention passes (their per-batch sums float32, summed in float64) and the far targets under
    # bf16 autocast, and the conversion's source streams too (LayerStream: calibrate.calibrated_layers' bf16, so the
    # fit's x and z): the CLI's where bf16 pays and the conversion compresses. The errors that choose the layer kept
    # then carry bf16's rounding, so an exact layer (nothing compressed) needs them off to be seen exact.
    bf16_passes: bool = False
    closed_form: bool = True  # o_proj in closed form before and after Adam
    seed: int = 0
    minibatch_tokens: int = MINIBATCH_TOKENS  # tokens per Adam step (whole fit sequences)
    queries: int = 0  # query positions per sequence in each Adam step's loss (random; 0: all)
    closed_form_queries: int = 0  # query positions per sequence in the closed forms' sums (one fixed sample; 0: all)
    # adam_fit's check: diverged when the recent loss is above this many times the start. Adam's first steps
    # raise every layer's loss (each weight moves by about lr whatever its scale); at lr 1e-3 SmolLM2's layers
    # at 25% come back below the start only after 30-50 steps (0.17 -> 0.22 at steps 0-20, 0.13 at step 100),
    # so 1 (the CLI's, measured so) also backs off runs that would recover; Qwen2.5-1.5B's diverging layers
    # stayed at 3x-60x.
    diverged: float = 1.0
    # far > 0: Adam's loss also compares, at every query at least far + 1 tokens in, the attention over the
    # keys at least `far` tokens back only (the first, sink token left out; softmax renormalised over them,
    # far_mask): what the source reads from far back, which the all-keys loss barely weighs because most of
    # each query's attention stays near. Weighted by far_weight, relative to that target's own scale.
    far: int = 0
    far_weight: float = 1.0
    far_queries: int = 256  # far query positions per sequence in each step's far term (random; 0: all)
    far_layers: tuple[int, ...] = ()  # the source layers whose fit has the far term (empty: every layer)
    # self_weight > 0: Adam's loss also compares the attention with each query reading only its own key (self_mask):
    # sum_h W_o[h] v_h(x_t), the values as a head that attends sharply to one token reads them, which the all-keys
    # loss weighs only as averages over many keys (whose errors partly cancel). Weighted by self_weight, relative
    # to that target's own scale, on self_queries random query positions per sequence (0: all).
    self_weight: float = 0.0
    self_queries: int = 256
    # scores_weight > 0: Adam's loss also compares this attention's weights reading the source's values through the
    # source's o_proj (MLAAttention.weights_over, SourceAttention.heads_output) against the source's output: the
    # scores held on their own, which the all-keys loss lets the fitted values make up for on average (the source's
    # scores over the source's values are its output exactly). Weighted by scores_weight, relative to the output's
    # scale, on scores_queries random query positions per sequence (0: all).
    scores_weight: float = 0.0
    scores_queries: int = 256
    # Adam's learning rate over the steps: "constant", or "cosine" (lr * (1 + cos(pi * step / steps)) / 2,
    # down to LR_FLOOR of lr); either after `warmup` steps rising linearly from lr / warmup.
    schedule: str = "constant"
    warmup: int = 0
    relative_lr: bool = False  # lr in units of each tensor's RMS (at least RELATIVE_FLOOR)

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be 0 or positive, got {self.warmup}")

    def lr_factor(self, step: int) -> float:
        """The factor of lr at Adam step `step` (0-based)."""
        factor = min(1.0, (step + 1) / self.warmup) if self.warmup else 1.0
        if self.schedule == "cosine":
            factor *= LR_FLOOR + (1 - LR_FLOOR) * 0.5 * (1 + math.cos(math.pi * step / max(1, self.steps)))
        return factor


# The CLI's far term (issue 34): chosen by its written rule on dev recall, dev keys and dev perplexity
# (benchmarks/results/retrieval_ladder.md, rope-64+fit-repeat2-far256-mid) for the built-in model at 50%:
# keys at least FAR_TOKENS back, on the middle-to-late layers, where benchmarks/recall_layers found that
# model losing most of its recall (layers L/2 up to 5L/6, one model's finding). For a conversion that keeps
# less than FAR_MIN_BUDGET of the cache it is off until a 25% variant passes the 25% rule; it needs fit
# sequences longer than FAR_TOKENS + 1. Its weight FAR_WEIGHT was chosen by the same kind of rule
# (rope-64+fit-repeat2-far256-mid-w2 against the weight-1 default).
FAR_TOKENS = 256
FAR_MIN_BUDGET = 0.5
FAR_WEIGHT = 2.0


def far_layers_for(num_layers: int, unwindowed: tuple[int, ...] = ()) -> tuple[int, ...]:
    """The layers the CLI's far term fits: for a source with sliding-window layers beside others, the layers
    without a window (`unwindowed`: the only ones that can read further back than their window; chosen on Gemma
    3 270M's dev keys and dev32 by benchmarks/gemma3's far-global rule); otherwise L/2 (floor) up to 5L/6
    (ceil), never empty."""
    if unwindowed and len(unwindowed) < num_layers:
        return tuple(unwindowed)
    return tuple(range(num_layers // 2, max(num_layers // 2 + 1, -(-5 * num_layers // 6))))


# The CLI's fit for a conversion that keeps at most RELATIVE_MAX_BUDGET of the cache (issue 36): Adam's rates
# relative to each tensor's RMS, 10 warmup steps, a cosine decay, no back-off check (what the relative rate is
# for), its loss on 256 sampled query positions per sequence. Chosen by the rule written before measuring
# (benchmarks/results/retrieval_ladder.md, cli-25+fit-rel200-q256 against cli-25+fit-repeat2): at 25% of the
# built-in model's cache about half the conversion time, with lower dev perplexity and key NLL. Above that
# budget the fit stays as it was until a run of its own passes there (the far term's rule at 50%).
RELATIVE_FIT = dict(lr=1e-2, relative_lr=True, schedule="cosine", warmup=10, diverged=1e9, queries=256)
RELATIVE_MAX_BUDGET = 0.25


def default_fit_settings(steps: int, seed: int, bf16: bool, cache_elements: int | None, source_elements: int,
                         num_layers: int, fit_tokens: int, unwindowed: tuple[int, ...] = ()) -> FitSettings:
    """The CLI's fit: `steps` Adam steps, with the far term where it was chosen: a conversion that keeps
    at least what --kv-budget FAR_MIN_BUDGET keeps (cache_elements of the source's source_elements per
    token per layer; None: unknown, neither), fit sequences of fit_tokens > FAR_TOKENS + 1; with
    RELATIVE_FIT where it was chosen: a conversion that keeps at most what --kv-budget
    RELATIVE_MAX_BUDGET keeps; bf16 (where bf16 products pay) for Adam, and for the other passes too when the
    conversion compresses (FitSettings.bf16_passes; chosen on dev keys, recall and dev32, retrieval_ladder
    cli-25-unitary+fit-bf16). unwindowed: the layers without a sliding window (far_layers_for)."""
    known = cache_elements is not None
    far = known and cache_elements >= budget_elements(FAR_MIN_BUDGET, source_elements) and fit_tokens > FAR_TOKENS + 1
    relative = known and cache_elements <= budget_elements(RELATIVE_MAX_BUDGET, source_elements)
    compresses = known and cache_elements < source_elements
    return FitSettings(steps=steps, seed=seed, bf16=bf16, bf16_passes=bf16 and compresses,
                       **({"far": FAR_TOKENS, "far_weight": FAR_WEIGHT, "far_layers": far_layers_for(num_layers, unwindowed)}
                          if far else {}),
                       **(RELATIVE_FIT if relative else {}))


def far_mask(T: int, far: int, window: int = 0, device=None) -> torch.Tensor:
    """[T, T] bool (True = attend): query i sees keys 1 <= j <= i - far (within a sliding window of
    `window`, if any). A row with no such key sees itself only (SDPA needs one key; the far loss
    scores rows far + 1 .. T - 1 only, which all have one)."""
    i = torch.arange(T, device=device)[:, None]
    j = torch.arange(T, device=device)[None, :]
    mask = (j >= 1) & (j <= i - far)
    if window:
        mask &= j > i - window
    return mask | ((j == i) & ~mask.any(dim=1, keepdim=True))


def self_mask(T: int, device=None) -> torch.Tensor:
    """[T, T] bool: each query sees its own key only."""
    return torch.eye(T, dtype=torch.bool, device=device)


def masked_targets(source_attention, x: torch.Tensor, mask: torch.Tensor, first: int, batch: int) -> torch.Tensor:
    """The source attention's output under `mask` [T, T] at positions first .. T - 1: [N, T - first, D]."""
    T = x.shape[1]
    out = x.new_empty(x.shape[0], T - first, x.shape[2])  # filled batch by batch: no list and concatenation
    with torch.no_grad():
        for s in range(0, x.shape[0], batch):
            out[s : s + batch] = source_attention(x[s : s + batch], mask[None, None])[:, first:]
    return out


def far_targets(source_attention, x: torch.Tensor, far: int, window: int, batch: int) -> torch.Tensor:
    """The source attention's far-only output (far_mask) at positions far + 1 .. T - 1: [N, T - far - 1, D]."""
    return masked_targets(source_attention, x, far_mask(x.shape[1], far, window, x.device), far + 1, batch)


def mean_square(t: torch.Tensor) -> torch.Tensor:
    """mean(t^2) as a float32 scalar (summed in float64) one slice of t's first dimension at a time: no squared
    copy of all of t (a fit's z is hundreds of MB on a 1.5B model). Float32 whatever t's dtype (the fit's x and z
    are bfloat16 with bf16 passes): a loss divided by it keeps its scale to float32's precision."""
    total = sum(float(part.double().pow(2).sum()) for part in t)
    return torch.tensor(total / t.numel(), dtype=torch.float32, device=t.device)


def _outputs(attn: MLAAttention, x: torch.Tensor, z: torch.Tensor, position_ids, at: torch.Tensor | None,
             bf16: bool = False):
    """(attention output, target): at every position, or at the query positions `at` [m] only; the
    output's products under bf16 autocast with `bf16`."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
        if at is None:
            return attn(x, position_ids=position_ids)[0], z
        return attn.outputs_at(x, at), z[:, at]


def _heads_output_gram(attn: MLAAttention, x: torch.Tensor, z: torch.Tensor, position_ids, batch: int,
                       at: torch.Tensor | None = None, bf16: bool = False):
    """Y^T Y [H*d_v, H*d_v], Y^T (Z - b_o) [H*d_v, D], ||Z - b_o||^2 and ||Z||^2 in float64 over all
    tokens (or the query positions `at` of every sequence), Y = o_proj's input. With bf16 (Y then has bf16's
    8 significant bits) each batch's products are float32, summed over the batches in float64."""
    part = torch.float32 if bf16 else torch.float64  # a batch's sums
    width = attn.o_proj.in_features
    yy = torch.zeros(width, width, dtype=torch.float64, device=x.device)
    yz = torch.zeros(width, z.shape[-1], dtype=torch.float64, device=x.device)
    zz = torch.zeros((), dtype=torch.float64, device=x.device)
    z_norm = torch.zeros((), dtype=torch.float64, device=x.device)
    bias = attn.o_proj.bias
    seen: list[torch.Tensor] = []
    hook = attn.o_proj.register_forward_hook(lambda module, args, out: seen.append(args[0]))
    try:
        for start in range(0, x.shape[0], batch):
            target = _outputs(attn, x[start : start + batch], z[start : start + batch], position_ids, at, bf16)[1]
            y = seen.pop().reshape(-1, width).to(part)  # [n, H*d_v]
            target = target.reshape(-1, z.shape[-1]).to(part)  # [n, D]
            z_norm += target.pow(2).sum().double()
            if bias is not None:  # the bias stays: W is fitted to Z - b_o
                target = target - bias.to(part)
            yy += (y.T @ y).double()
            yz += (y.T @ target).double()
            zz += target.pow(2).sum().double()
    finally:
        hook.remove()
    return yy, yz, zz, z_norm


@torch.no_grad()
def refit_o_proj_errors(attn: MLAAttention, x: torch.Tensor, z: torch.Tensor, position_ids, batch: int,
                        at: torch.Tensor | None = None, bf16: bool = False) -> tuple[float, float]:
    """Steps 1 and 3: the ridge least-squares o_proj (module docstring), in place. Returns the layer's
    output error (output_error's value) before and after it, from the same sums, without another pass
    over the tokens: ||Y W^T - (Z - b)||^2 = tr(W Y^T Y W^T) - 2 tr(W Y^T (Z - b)) + ||Z - b||^2."""
    yy, yz, zz, z_norm = _heads_output_gram(attn, x, z, position_ids, batch, at, bf16)
    norm = max(float(z_norm), 1e-30)

    def error(w: torch.Tensor) -> float:  # w [D, H*d_v] float64
        return float(((w @ yy * w).sum() - 2 * (w.T * yz).sum() + zz).clamp_min(0)) / norm

    w0 = attn.o_proj.weight.double()  # [D, H*d_v]
    before = error(w0)
    lam = RIDGE * yy.diagonal().mean()
    eye = torch.eye(yy.shape[0], dtype=yy.dtype, device=yy.device)
    w = torch.linalg.solve(yy + lam * eye, yz + lam * w0.T).T  # [D, H*d_v]
    attn.o_proj.weight.copy_(w.to(attn.o_proj.weight.dtype))
    return before, error(attn.o_proj.weight.double())  # as stored


def refit_o_proj(attn: MLAAttention, x: torch.Tensor, z: torch.Tensor, position_ids, batch: int,
                 at: torch.Tensor | None = None, bf16: bool = False) -> float:
    """refit_o_proj_errors' fit, in place; the output error after it."""
    return refit_o_proj_errors(attn, x, z, position_ids, batch, at, bf16)[1]


@torch.no_grad()
def output_error(attn: MLAAttention, x: torch.Tensor, z: torch.Tensor, position_ids, batch: int,
                 at: torch.Tensor | None = None, bf16: bool = False) -> float:
    """||Attn_mla(X) - Z||^2 / ||Z||^2 over all tokens (or the query positions `at` of every sequence)."""
    err = z_norm = 0.0
    for s in range(0, x.shape[0], batch):  # float64 per batch of sequences, no copy of all of z
        out, target = _outputs(attn, x[s : s + batch], z[s : s + batch], position_ids, at, bf16)
        err += float((out - target).double().pow(2).sum())
        z_norm += float(target.double().pow(2).sum())
    return err / max(z_norm, 1e-30)


def _adam_run(attn: MLAAttention, x: torch.Tensor, z: torch.Tensor, position_ids, batch: int,
              settings: FitSettings, lr: float, check: bool, z_far: torch.Tensor | None = None,
              z_self: torch.Tensor | None = None, source=None) -> bool:
    """`settings.steps` Adam steps at `lr`, in place; with `check`, False (stopped) when the loss has
    not come back below its start by the check step (see adam_fit). z_far: far_targets' [N, T - far - 1, D];
    z_self: the source's output under self_mask [N, T, D]; source: the SourceAttention whose values the scores
    term reads (settings.scores_weight)."""
    params = list(attn.parameters())
    if settings.relative_lr:  # each tensor's rate in units of its own RMS (Adam's steps are about lr each)
        groups = [{"params": [p], "lr": lr * max(float(p.detach().pow(2).mean().sqrt()), RELATIVE_FLOOR)} for p in params]
    else:
        groups = [{"params": params, "lr": lr}]
    for group in groups:
        group["base_lr"] = group["lr"]
    opt = torch.optim.Adam(groups)
    scheduled = settings.schedule != "constant" or settings.warmup
    gen = torch.Generator().manual_seed(settings.seed)
    scale = mean_square(z)
    if z_far is not None:
        T, far = x.shape[1], settings.far
        far_at = torch.arange(far + 1, T, device=x.device)  # [T - far - 1] scored query positions
        far_seen = far_mask(T, far, attn.config.window(attn.layer_idx), x.device)[far + 1 :]  # [T - far - 1, T]
        far_scale = mean_square(z_far)
    if z_self is not None:
        eye = self_mask(x.shape[1], x.device)  # [T, T]
        self_scale = mean_square(z_self)
    losses: list[float] = []
    check_at = max(2 * DIVERGENCE_WINDOW, settings.steps // 4) if check else 0
    with torch.enable_grad():
        for step in range(settings.steps):
            pick = torch.randint(0, x.shape[0], (batch,), generator=gen).to(x.device)  # [batch] sequences
            at = None  # every query position, or an unbiased sample of them [m]
            if 0 < settings.queries < x.shape[1]:
                at = torch.randperm(x.shape[1], generator=gen)[: settings.queries].sort().values.to(x.device)
            out, target = _outputs(attn, x[pick], z[pick], position_ids, at, settings.bf16)
            loss = (out.float() - target).pow(2).mean() / scale
            if z_far is not None:
                rows = torch.arange(far_at.shape[0], device=x.device)  # [m] of the far positions
                if 0 < settings.far_queries < rows.shape[0]:
                    rows = torch.randperm(rows.shape[0], generator=gen)[: settings.far_queries].sort().values.to(x.device)
                with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=settings.bf16):
                    out_far = attn.outputs_at(x[pick], far_at[rows], far_seen[rows])  # [batch, m, D]
                far_loss = (out_far.float() - z_far[pick][:, rows]).pow(2).mean() / far_scale
                loss = loss + settings.far_weight * far_loss
            if z_self is not None:
                own = torch.arange(x.shape[1], device=x.device)  # [m] query positions, each reading itself
                if 0 < settings.self_queries < x.shape[1]:
                    own = torch.randperm(x.shape[1], generator=gen)[: settings.self_queries].sort().values.to(x.device)
                with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=settings.bf16):
                    out_self = attn.outputs_at(x[pick], own, eye[own])  # [batch, m, D]
                self_loss = (out_self.float() - z_self[pick][:, own]).pow(2).mean() / self_scale
                loss = loss + settings.self_weight * self_loss
            if settings.scores_weight:
                read = torch.arange(x.shape[1], device=x.device)  # [m] query positions whose scores are held
                if 0 < settings.scores_queries < x.shape[1]:
                    read = torch.randperm(x.shape[1], generator=gen)[: settings.scores_queries].sort().values.to(x.device)
                with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=settings.bf16):
                    values = source.value_rows(x[pick])  # [batch, T, g*d], the source's
                    out_scores = source.heads_output(attn.weights_over(x[pick], read, values))  # [batch, m, D]
                scores_loss = (out_scores.float() - z[pick][:, read]).pow(2).mean() / scale
                loss = loss + settings.scores_weight * scores_loss
            if step < check_at:  # read back only while the check needs it (a device sync each)
                losses.append(float(loss.detach()))
                start = losses[0]
                if step + 1 == check_at and sum(losses[-DIVERGENCE_WINDOW:]) / DIVERGENCE_WINDOW > settings.diverged * start:
                    return False
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if scheduled:
                for group in opt.param_groups:
                    group["lr"] = group["base_lr"] * settings.lr_factor(step)
            opt.step()
    return True


def adam_fit(attn: MLAAttention, x: torch.Tensor, z: torch.Tensor, position_ids, batch: int, settings: FitSettings,
             z_far: torch.Tensor | None = None, z_self: torch.Tensor | None = None, source=None) -> float:
    """Step 2: Adam on every parameter of `attn` against the relative squared output error, in place;
    returns the learning rate that ran. Adam's first steps move every weight by about lr whatever
    the weights' scale, so a rate that suits one model throws another's weights around:
    Qwen2.5-1.5B's attention weights are ~10x smaller than SmolLM2's, and on its layer 0 (25%) the
    first step took the loss from 0.21 to 13.5 at 3e-3 (still 0.63 after 200 steps), to 2.1 at 1e-3
    (0.165 at the end, back below the start only after ~50 steps) and to 0.66 at 3e-4 (0.165, below
    the start by step ~20). So at a quarter of the steps (at least 2 * DIVERGENCE_WINDOW) the mean
    minibatch loss of the last DIVERGENCE_WINDOW steps must be below the loss before the first step;
    if not, the layer is reset and the run restarts at a third of the rate, at most MAX_BACKOFFS
    times (the last run is not checked). A run that passes its check is exactly the plain run."""
    start = {k: v.detach().clone() for k, v in attn.state_dict().items()}
    lr = settings.lr
    try:
        for _ in range(MAX_BACKOFFS):
            if _adam_run(attn, x, z, position_ids, batch, settings, lr, check=True, z_far=z_far, z_self=z_self,
                         source=source):
                return lr
            with torch.no_grad():
                attn.load_state_dict(start)
            lr /= BACKOFF
        _adam_run(attn, x, z, position_ids, batch, settings, lr, check=False, z_far=z_far, z_self=z_self,
                  source=source)  # the last one runs through
        return lr
    finally:
        for p in attn.parameters():
            p.requires_grad_(False)


def fit_layer(config, layer: MLALayer, x: torch.Tensor, z: torch.Tensor,
              settings: FitSettings, index: int = 0, source_attention=None) -> tuple[MLALayer, dict]:
    """One converted layer fitted to the source attention's output.

    config: the source's; layer: the method's MLA layer; x [N, T, D]: the fit sequences' attention
    input (float32, not inference tensors; bfloat16 only with settings.bf16_passes, which runs every pass that
    reads them under bf16 autocast); z [N, T, D]: the source attention's output on x (x's dtype).
    index: the source layer (its sliding window, if any, applies). source_attention(x [n, T, D],
    mask [1, 1, T, T] bool) -> [n, T, D]: the source attention under a mask (settings.far and self_weight need it;
    scores_weight needs its `source`, the layer's SourceAttention, too).
    Returns the fitted layer (same shapes) and {"output_error": [before, after]} (relative, on x), with
    "fit_lr", Adam's learning rate after any backoff, when Adam ran.
    """
    N, T, _ = x.shape
    attn = mla_attention(config, layer, x.device, index)  # float32
    batch = max(1, settings.minibatch_tokens // T)  # sequences per forward and per Adam step
    position_ids = torch.arange(T, device=x.device)[None]
    attn.eval()  # the expanded path, differentiable; no cache
    at = None  # the closed forms' query positions: all, or one fixed sample for every candidate
    if 0 < settings.closed_form_queries < T:
        gen = torch.Generator().manual_seed(settings.seed + 1)
        at = torch.randperm(T, generator=gen)[: settings.closed_form_queries].sort().values.to(x.device)  # [m]
    if settings.closed_form:  # the error before comes from the closed form's own sums
        before, after = refit_o_proj_errors(attn, x, z, position_ids, batch, at, settings.bf16_passes)
    else:
        before = after = output_error(attn, x, z, position_ids, batch, at, settings.bf16_passes)
    best, best_error = layer, before  # an exact layer stays: Adam's unit-size steps can only perturb it
    info = {}
    if settings.steps:
        if after < best_error - ERROR_NOISE:  # step 1 alone is a candidate too
            best, best_error = layer_of(attn, layer), after
        z_far = None
        if settings.far and (not settings.far_layers or index in settings.far_layers):
            if source_attention is None:
                raise ValueError("FitSettings.far needs the source attention (fit_layer's source_attention)")
            if settings.far + 1 >= T:
                raise ValueError(f"FitSettings.far ({settings.far}) must be below the fit sequences' length - 1 ({T - 1})")
            # attn holds this one layer as its layer 0 (calibrate.mla_attention): its window is window(0)
            with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=settings.bf16_passes):
                z_far = far_targets(source_attention, x, settings.far, attn.config.window(attn.layer_idx), batch)
        z_self = None
        if settings.self_weight:
            if source_attention is None:
                raise ValueError("FitSettings.self_weight needs the source attention (fit_layer's source_attention)")
            with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=settings.bf16_passes):
                z_self = masked_targets(source_attention, x, self_mask(T, x.device), 0, batch)
        source = getattr(source_attention, "source", None)  # calibrate.MaskedSourceAttention's SourceAttention
        if settings.scores_weight and source is None:
            raise ValueError("FitSettings.scores_weight needs the source attention's values (fit_layer's "
                             "source_attention with its SourceAttention)")
        source = source.outside_inference() if settings.scores_weight else None
        info["fit_lr"] = adam_fit(attn, x, z, position_ids, batch, settings, z_far, z_self, source)
        after = (refit_o_proj if settings.closed_form else output_error)(attn, x, z, position_ids, batch, at,
                                                                          settings.bf16_passes)
    if after < best_error - ERROR_NOISE:
        best, best_error = layer_of(attn, layer), after
    return best, {"output_error": [round(before, 6), round(best_error, 6)], **info}


def layer_of(attn: MLAAttention, base: MLALayer) -> MLALayer:
    """`base` with every projection replaced by attn's."""
    return base.with_tensors({k: v.detach().clone() for k, v in attn.state_dict().items()})


__all__ = ["DEFAULT_FIT_CALIBRATION", "WIDE_FIT_HIDDEN", "WIDE_FIT_MAX_BUDGET", "WIDE_FIT_SAMPLES", "default_fit_samples", "FAR_MIN_BUDGET", "RELATIVE_FIT", "RELATIVE_MAX_BUDGET", "FAR_TOKENS", "FAR_WEIGHT", "FitSettings", "default_fit_settings",
           "far_layers_for", "far_mask", "far_targets", "masked_targets", "self_mask", "fit_layer", "layer_of", "output_error",
           "refit_o_proj", "refit_o_proj_errors"]
