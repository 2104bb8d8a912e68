"""BKV balance and the joint PCA of [K_nope/alpha; V]: the latent of TransMLA (ALGORITHMS.md 3-5).

Input: the partial-RoPE layer (rorope.PartialRope: shared rope key, per-head rope queries, the NoPE
key components k_nope shared by all heads, and nope_to_head[j] mapping them back to head j's key
coordinates) plus the source V and the calibration gram G = E[[x;1][x;1]^T].

    alpha  = mean_c sqrt(E k_nope,c^2) / mean_c sqrt(E v_c^2)     (column norms; BKV)
    Y      = [k_nope / alpha ; v]          (2*g*d - r outputs of the augmented input [x; 1])
    Y ~= U_R U_R^T Y,  U_R = top-R eigenvectors of E[Y Y^T] = W G W^T   (lowrank.low_rank)
    latent c = U_R^T Y  -> kv_a_proj rows [W_DKV | bias];  kv_b per head h of group j:
    W_UK[h] = nope_to_head[j] @ (alpha * U_R[K rows]),  W_UV[h] = U_R[V rows of group j].

At R = 2*g*d - r, U_R is square orthogonal: the layer equals the partial-RoPE layer exactly.

Optional attention metric (ours, not in the published method): the PCA above spends its rank on
what is large in [k_nope; v], not on what the layer uses. A key error e_k changes head h's score
by q_h . N_j e_k and a value error e_v its output by W_o,h e_v, so weight each block by
    M_K = sum_h N_j^T E[q_h q_h^T] N_j   (query-weighted keys: expected squared score error)
    M_V = blockdiag_j sum_{h in j} W_o,h^T W_o,h   (output-weighted values)
and PCA S Y with S = blockdiag(M_K^(1/2), M_V^(1/2)): min E||S (Y - Y_hat)||^2, Y_hat = S^-1 U U^T S Y.
BKV balancing is applied to the weighted blocks (equal mean column norms, as published). S is
invertible (a tiny ridge), so full rank stays exact. "output" weights only the values (M_K = I).
Measured on SmolLM2 (benchmarks/results/transmla_bench.md, dev32): with long calibration sequences
"output" beats the plain PCA at 50% of the cache, but with our default calibration (many short
sequences) the plain PCA is better at every budget; weighting the keys by the queries hurts
below 50%. Both stay options (TransMLAPlan.pca_metric), not defaults.
Optional centring (not in the published method): PCA of the covariance instead of the second
moment, c = U_R^T (Y - E Y). The K mean only adds q . const to every score of a query (softmax
drops it); the V mean passes through attention unchanged (weights sum to one) and is folded into
o_proj's bias. Exact at full rank as well.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layers import MLALayer
from ..lowrank import low_rank
from .rorope import PartialRope


def bkv_alpha(k_nope: torch.Tensor, wv: torch.Tensor, gram: torch.Tensor) -> float:
    """BKV ratio: mean column norm of K_nope over mean column norm of V (augmented maps, float64)."""
    g = gram.double()
    k_sq = torch.einsum("od,de,oe->o", k_nope.double(), g, k_nope.double()).clamp_min(0)  # [.] E k_c^2
    v_sq = torch.einsum("od,de,oe->o", wv.double(), g, wv.double()).clamp_min(0)
    if k_sq.numel() == 0:
        return 1.0
    k_norm, v_norm = k_sq.sqrt().mean(), v_sq.sqrt().mean()
    if float(k_norm) == 0.0 or float(v_norm) == 0.0:
        return 1.0
    return float(k_norm / v_norm)


def centred_gram(gram: torch.Tensor) -> torch.Tensor:
    """Covariance of the augmented input: G - m m^T with m = E[x; 1] = G[:, -1] (last coordinate 1)."""
    g = gram.double()
    m = g[:, -1]  # [D+1]
    return g - m[:, None] * m[None, :]


@dataclass
class JointPCA:
    up_k: torch.Tensor  # [g*d - r, R] (alpha folded in: k_nope ~= up_k @ c)
    up_v: torch.Tensor  # [g*d, R]
    down: torch.Tensor  # [R, D+1] latent c = down @ [x; 1]
    alpha: float
    energy: torch.Tensor  # [2*g*d - r] eigenvalues of E[Y Y^T] (or its covariance), descending
    v_mean: torch.Tensor | None  # [g*d] E v, restored through o_proj's bias (centred only)

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    def kept_energy(self) -> float:
        total = float(self.energy.sum())
        return float(self.energy[: self.rank].sum()) / total if total > 0 else 1.0


@dataclass
class AttentionMetric:
    """Square roots of the block weights of the attention metric (module docstring) and their inverses."""

    key: torch.Tensor  # [g*d - r, g*d - r] M_K^(1/2)
    key_inv: torch.Tensor
    value: torch.Tensor  # [g*d, g*d] M_V^(1/2)
    value_inv: torch.Tensor


def _sqrt_and_inverse(m: torch.Tensor, ridge: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """M^(1/2) and M^(-1/2) of a symmetric PSD matrix, with a ridge of `ridge` * mean eigenvalue."""
    m = 0.5 * (m + m.T).double()
    evals, evecs = torch.linalg.eigh(m)
    evals = evals.clamp_min(0) + ridge * float(evals.clamp_min(0).mean().clamp_min(1e-300))
    return (evecs * evals.sqrt()) @ evecs.T, (evecs / evals.sqrt()) @ evecs.T


def attention_metric(
    nope_to_head: torch.Tensor, query_moments: torch.Tensor | None, wo: torch.Tensor, num_heads: int
) -> AttentionMetric:
    """The metric of the attention-weighted PCA.

    nope_to_head [g, d, g*d - r] (rorope.PartialRope), query_moments [g, d, d] = sum over group j's
    query heads of E[q_h q_h^T] (None: keys unweighted, M_K = I), wo [D, H*d].
    """
    g, d, nn = nope_to_head.shape
    group = num_heads // g
    n = nope_to_head.double()
    if query_moments is None:
        m_k = torch.eye(nn, dtype=torch.float64)
    else:
        m_k = torch.einsum("jda,jde,jeb->ab", n, query_moments.double(), n)  # [g*d - r, g*d - r]
    wo_heads = wo.double().view(wo.shape[0], num_heads, d)  # [D, H, d]
    per_head = torch.einsum("xhd,xhe->hde", wo_heads, wo_heads)  # [H, d, d] W_o,h^T W_o,h
    m_v = torch.block_diag(*per_head.view(g, group, d, d).sum(1))  # [g*d, g*d]
    key, key_inv = _sqrt_and_inverse(m_k)
    value, value_inv = _sqrt_and_inverse(m_v)
    return AttentionMetric(key, key_inv, value, value_inv)


def joint_pca(
    k_nope: torch.Tensor,
    wv: torch.Tensor,
    gram: torch.Tensor,
    rank: int,
    balance: bool = True,
    centre: bool = False,
    metric: AttentionMetric | None = None,
) -> JointPCA:
    """Rank-`rank` latent of [k_nope/alpha; v] (k_nope [g*d - r, D+1], wv [g*d, D+1] augmented),
    in the attention metric when one is given (module docstring)."""
    k_w, v_w = k_nope.double(), wv.double()
    if metric is not None:
        k_w, v_w = metric.key @ k_w, metric.value @ v_w  # S Y
    alpha = bkv_alpha(k_w, v_w, gram) if balance else 1.0
    w = torch.cat((k_w / alpha, v_w))  # [2gd - r, D+1]
    weight = centred_gram(gram) if centre else gram.double()
    fac = low_rank(w, rank, weight)  # up [2gd - r, R], down = up^T w
    down = fac.down.clone()
    nk = k_nope.shape[0]
    up_k, up_v = fac.up[:nk] * alpha, fac.up[nk:]
    v_mean = None
    if centre:
        y_mean = w @ gram.double()[:, -1]  # [2gd - r] E Y
        down[:, -1] -= fac.up.T @ y_mean  # c = U^T (Y - E Y)
        v_mean = y_mean[nk:]
    if metric is not None:  # back from the weighted space: Y_hat = S^-1 U c
        up_k, up_v = metric.key_inv @ up_k, metric.value_inv @ up_v
        v_mean = None if v_mean is None else metric.value_inv @ v_mean
    return JointPCA(up_k=up_k, up_v=up_v, down=down, alpha=alpha, energy=fac.energy, v_mean=v_mean)


def identity_latent(k_nope: torch.Tensor, wv: torch.Tensor) -> JointPCA:
    """The full-rank latent without any PCA: c = [k_nope; v] (the partial-RoPE model itself)."""
    nk, nv = k_nope.shape[0], wv.shape[0]
    eye = torch.eye(nk + nv, dtype=torch.float64)
    return JointPCA(
        up_k=eye[:nk], up_v=eye[nk:], down=torch.cat((k_nope.double(), wv.double())),
        alpha=1.0, energy=torch.zeros(nk + nv, dtype=torch.float64), v_mean=None,
    )


def assemble_layer(
    wq: torch.Tensor,
    wo: torch.Tensor,
    bo: torch.Tensor | None,
    partial: PartialRope,
    latent: JointPCA,
    num_heads: int,
    *,
    q_bias: bool,
    kv_bias: bool,
    q_lora_rank: int | None = None,
    gram: torch.Tensor | None = None,
) -> MLALayer:
    """The MLA layer: per head q = [q_h (d, source) | q_rope (r)], kv_b = [W_UK (d) | W_UV (d)].

    wq [H*d, D+1] augmented source query; wo [D, H*d]. q_bias / kv_bias: whether the layer carries
    those biases (the source had them, or centring made the latent need one).
    q_lora_rank: PCA of the query activations (rank Q), q = q_b(q_a x) + b, the bias kept exact.
    """
    g, d, nn = partial.nope_to_head.shape
    group = num_heads // g
    q = wq.double().view(num_heads, d, -1)
    q_full = torch.cat((q, partial.q_rope.double()), dim=1).reshape(-1, q.shape[-1])  # [H*(d+r), D+1]
    kv_b = []
    for h in range(num_heads):
        j = h // group
        w_uk = partial.nope_to_head[j].double() @ latent.up_k  # [d, R]
        w_uv = latent.up_v[j * d : (j + 1) * d]  # [d, R]
        kv_b.append(torch.cat((w_uk, w_uv)))
    kv_b_proj = torch.cat(kv_b)  # [H*2d, R]
    kv_a = torch.cat((latent.down, partial.k_rope.double()))  # [R + r, D+1]
    o_bias = None if bo is None else bo.double()
    if latent.v_mean is not None:  # V mean through attention, then o_proj (weights sum to one)
        v_heads = torch.cat([latent.v_mean[(h // group) * d : (h // group + 1) * d] for h in range(num_heads)])
        extra = wo.double() @ v_heads  # [D]
        o_bias = extra if o_bias is None else o_bias + extra
    layer = MLALayer(
        q_proj=q_full[:, :-1].float(),
        q_bias=q_full[:, -1].float() if q_bias else None,
        kv_a_proj=kv_a[:, :-1].float(),
        kv_a_bias=kv_a[:, -1].float() if kv_bias else None,
        kv_b_proj=kv_b_proj.float(),
        o_proj=wo.float(),
        o_bias=None if o_bias is None else o_bias.float(),
        rope_inv_freq=partial.inv_freq.float(),
    )
    if q_lora_rank is not None:
        if gram is None:
            raise ValueError("a low-rank query needs the calibration gram")
        x_gram = gram.double()[:-1, :-1]  # E[x x^T]: the bias stays exact on q_b_proj
        fac = low_rank(q_full[:, :-1], q_lora_rank, x_gram)
        layer.q_a_proj = fac.down.float()  # [Q, D]
        layer.q_b_proj = fac.up.float()  # [H*(d+r), Q]
    return layer


__all__ = ["AttentionMetric", "JointPCA", "attention_metric", "assemble_layer", "bkv_alpha", "centred_gram", "identity_latent", "joint_pca"]
