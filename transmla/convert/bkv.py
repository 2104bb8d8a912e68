"""BKV balance and the joint PCA of [K_nope/alpha; V]: the latent of TransMLA (ALGORITHMS.md 3-5).

Input: the partial-RoPE layer (rope.PartialRope: shared rope key, per-head rope queries, the NoPE
key components k_nope shared by all heads, and nope_to_head[j] mapping them back to head j's key
coordinates) plus the source V and the calibration gram G = E[[x;1][x;1]^T].

    alpha  = mean_c sqrt(E k_nope,c^2) / mean_c sqrt(E v_c^2)     (column norms; BKV)
    Y      = [k_nope / alpha ; v]          (2*g*d - r outputs of the augmented input [x; 1])
    Y ~= U_R U_R^T Y,  U_R = top-R eigenvectors of E[Y Y^T] = W G W^T   (lowrank.low_rank)
    latent c = U_R^T Y  -> kv_a_proj rows [W_DKV | bias];  kv_b per head h of group j:
    W_UK[h] = nope_to_head[j] @ (alpha * U_R[K rows]),  W_UV[h] = U_R[V rows of group j].

At R = 2*g*d - r, U_R is square orthogonal: the layer equals the partial-RoPE layer exactly.
Optional centring (not in the published method): PCA of the covariance instead of the second
moment, c = U_R^T (Y - E Y). The K mean only adds q . const to every score of a query (softmax
drops it); the V mean passes through attention unchanged (weights sum to one) and is folded into
o_proj's bias. Exact at full rank as well.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layers import MLALayer
from .lowrank import low_rank, with_bias_column
from .rope import PartialRope


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


def joint_pca(
    k_nope: torch.Tensor,
    wv: torch.Tensor,
    gram: torch.Tensor,
    rank: int,
    balance: bool = True,
    centre: bool = False,
) -> JointPCA:
    """Rank-`rank` latent of [k_nope/alpha; v] (k_nope [g*d - r, D+1], wv [g*d, D+1] augmented)."""
    alpha = bkv_alpha(k_nope, wv, gram) if balance else 1.0
    w = torch.cat((k_nope.double() / alpha, wv.double()))  # [2gd - r, D+1]
    weight = centred_gram(gram) if centre else gram.double()
    fac = low_rank(w, rank, weight)  # up [2gd - r, R], down = up^T w
    down = fac.down.clone()
    v_mean = None
    if centre:
        y_mean = w @ gram.double()[:, -1]  # [2gd - r] E Y
        down[:, -1] -= fac.up.T @ y_mean  # c = U^T (Y - E Y)
        v_mean = y_mean[k_nope.shape[0] :]
    nk = k_nope.shape[0]
    return JointPCA(
        up_k=fac.up[:nk] * alpha, up_v=fac.up[nk:], down=down, alpha=alpha, energy=fac.energy, v_mean=v_mean
    )


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


def augmented(w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """[W | b] in float64 (zeros when there is no bias)."""
    return with_bias_column(w.double(), None if b is None else b.double())


__all__ = ["JointPCA", "assemble_layer", "augmented", "bkv_alpha", "centred_gram", "identity_latent", "joint_pca"]
