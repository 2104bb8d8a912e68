"""MHA2MLA step 2: low rank on the NoPE keys and the values, W = [W_k,nope; W_v] ~= up @ down.

ALGORITHMS.md, MHA2MLA 2. The layer coming in (partial_rope.partial_rope) has an uncompressed
latent c_full = W x (+ b) with W = [W_k,nope (k_dims rows); W_v] and up-projection B = kv_b_proj
(W_UK/W_UV, selectors). A rank-R factorisation W ~= U @ A gives the MLA layer
kv_a latent = A (R dims), kv_b = B @ U: a named truncation, exact at full rank.

- joint: one factorisation of W (the paper's SVD_joint).
- split: separate factorisations of W_k,nope and W_v that SHARE the total rank R (the public code
  gives each the full R, doubling the cache). Rule: keep the R largest eigenvalues across the two
  spectra (R_k from K's, R_v = R - R_k from V's). Each block's error is the sum of its discarded
  eigenvalues, so this minimises the summed error ||K - K_hat||^2 + ||V - V_hat||^2 (in the chosen
  norm) over every split R_k + R_v = R. The latent is [c_k (R_k); c_v (R_v)], W_UK reads c_k only.
- weighting none: plain weight SVD, min ||W - W_hat||_F (lowrank.low_rank with gram None). The
  source's k/v biases stay exact in kv_b's bias, as in the public code.
- weighting activation: min E||(W - W_hat)[x; 1]||^2 with the calibration gram C = E[[x;1][x;1]^T]
  (= SVD of [W|b] C^(1/2), then undo: lowrank.low_rank with gram C, PCA of the outputs). The bias
  is the input column of the constant 1, so it rides in the latent (kv_a's bias).
  center=True uses the centred covariance instead and puts the output mean back through kv_b's
  bias: the best rank-R affine fit of the outputs (a constant added to K_nope shifts every score of
  a query equally, softmax drops it; a constant in V passes to the output unchanged).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..layers import MLALayer
from ..lowrank import Factorization, low_rank, with_bias_column

SVD_MODES = ("joint", "split")
WEIGHTINGS = ("none", "activation")


@dataclass
class LatentFactors:
    up: torch.Tensor  # [out, R] float64
    down: torch.Tensor  # [R, in] float64 (in = D, or D + 1 with the bias column)
    out_bias: torch.Tensor | None  # [out] a constant added after the up-projection, or None
    ranks: tuple[int, int] | None  # (R_k, R_v) for split, None for joint


def share_rank(energy_k: torch.Tensor, energy_v: torch.Tensor, rank: int) -> tuple[int, int]:
    """(R_k, R_v) with R_k + R_v = rank keeping the `rank` largest eigenvalues of both spectra.

    Ties go to K (stable sort, K first). Each count is capped by its block's size.
    """
    if not 0 <= rank <= energy_k.numel() + energy_v.numel():
        raise ValueError(f"rank {rank} exceeds the {energy_k.numel()} + {energy_v.numel()} outputs of K_nope and V")
    both = torch.cat((energy_k.double(), energy_v.double()))  # [out_k + out_v]
    top = torch.sort(both, descending=True, stable=True).indices[:rank]
    r_k = int((top < energy_k.numel()).sum())
    return r_k, rank - r_k


def _factor(w: torch.Tensor, rank: int, gram: torch.Tensor | None) -> Factorization:
    if w.shape[0] == 0:  # no K_nope when every pair stays rope
        empty = w.new_zeros(0, 0)
        return Factorization(up=empty, down=w.new_zeros(0, w.shape[1]), energy=w.new_zeros(0))
    return low_rank(w, rank, gram)


@dataclass
class LatentSpectrum:
    """Full-rank eigen-decompositions of the latent map's blocks; truncate() gives any rank cheaply."""

    blocks: list[Factorization]  # joint: [W]; split: [W_k,nope, W_v] (every eigenvector, descending)
    out_bias: torch.Tensor | None  # weight SVD: the exact bias; centred: the output mean; else None
    center: bool

    @property
    def max_rank(self) -> int:
        return sum(b.up.shape[1] for b in self.blocks)

    def truncate(self, rank: int) -> LatentFactors:
        if not 0 <= rank <= self.max_rank:
            raise ValueError(f"rank {rank} does not fit a latent with {self.max_rank} dims")
        if len(self.blocks) == 1:
            f = self.blocks[0]
            up, down, ranks = f.up[:, :rank], f.down[:rank], None  # [out, R], [R, in]
        else:
            fk, fv = self.blocks
            r_k, r_v = share_rank(fk.energy, fv.energy, rank)
            up = torch.block_diag(fk.up[:, :r_k], fv.up[:, :r_v])  # [out, R]
            down = torch.cat((fk.down[:r_k], fv.down[:r_v]))  # [R, in]
            ranks = (r_k, r_v)
        out_bias = self.out_bias
        if self.center:
            # y_hat = U U^T (y - mu) + mu: the latent carries U^T y, the bias mu - U U^T mu.
            out_bias = out_bias - up @ (up.T @ out_bias)
        return LatentFactors(up=up, down=down, out_bias=out_bias, ranks=ranks)


def latent_spectrum(
    w: torch.Tensor,
    bias: torch.Tensor | None,
    k_dims: int,
    mode: str = "joint",
    gram: torch.Tensor | None = None,
    center: bool = False,
) -> LatentSpectrum:
    """Decompose the latent map c_full = W x + b (w [out, D], bias [out] or None) once, for every rank.

    gram None: weight SVD of W (bias kept exactly as out_bias). gram [D+1, D+1] (the layer's
    calibration gram, constant last): activation-aware on [W | b].
    """
    if mode not in SVD_MODES:
        raise ValueError(f"unknown svd mode {mode!r}; choose one of {', '.join(SVD_MODES)}")
    out = w.shape[0]
    w = w.double()
    center = center and gram is not None
    if gram is None:
        wa, cov, out_bias = w, None, (None if bias is None else bias.double())
    else:
        wa = with_bias_column(w, bias).double()  # [out, D+1] acts on [x; 1]
        cov = gram.double()
        if cov.shape != (wa.shape[1], wa.shape[1]):
            raise ValueError(f"gram of shape {tuple(cov.shape)} does not match {wa.shape[1]} inputs (D + 1)")
        out_bias = None
        if center:
            mean = cov[:, -1]  # [D+1] E[[x; 1]] (the constant row of the gram)
            cov = cov - torch.outer(mean, mean)  # centred; the constant's row/col become 0
            out_bias = wa @ mean  # [out] the output mean
    if mode == "joint":
        blocks = [_factor(wa, out, cov)]
    else:
        blocks = [_factor(wa[:k_dims], k_dims, cov), _factor(wa[k_dims:], out - k_dims, cov)]
    return LatentSpectrum(blocks=blocks, out_bias=out_bias, center=center)


def factor_latent(
    w: torch.Tensor,
    bias: torch.Tensor | None,
    k_dims: int,
    rank: int,
    mode: str = "joint",
    gram: torch.Tensor | None = None,
    center: bool = False,
) -> LatentFactors:
    """Rank-`rank` factorisation of the latent map (see latent_spectrum)."""
    return latent_spectrum(w, bias, k_dims, mode, gram, center).truncate(rank)


def split_latent(layer: MLALayer) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The uncompressed latent map of a partial-RoPE layer: (W [full, D], b [full] or None)."""
    full = layer.kv_a_proj.shape[0] - 2 * layer.rope_inv_freq.numel()
    return layer.kv_a_proj[:full], None if layer.kv_a_bias is None else layer.kv_a_bias[:full]


def compress_latent(
    layer: MLALayer,
    k_dims: int,
    rank: int,
    mode: str = "joint",
    gram: torch.Tensor | None = None,
    center: bool = False,
) -> tuple[MLALayer, LatentFactors]:
    """Truncate the latent of a partial-RoPE layer to `rank` dims (see the module notes).

    layer: kv_a rows [latent_full (k_dims of K_nope, then V) | rope key]; kv_b [H*(d_nope+d_v), latent_full].
    """
    w, b = split_latent(layer)
    f = factor_latent(w, b, k_dims, rank, mode, gram, center)
    return apply_factors(layer, f), f


def apply_factors(layer: MLALayer, f: LatentFactors) -> MLALayer:
    """The layer with latent W ~= up @ down: kv_a latent rows = down, kv_b = kv_b @ up."""
    d_r = 2 * layer.rope_inv_freq.numel()
    full = layer.kv_a_proj.shape[0] - d_r
    if layer.kv_b_proj.shape[1] != full or f.up.shape[0] != full:
        raise ValueError("kv_b_proj does not match the latent of kv_a_proj")
    rank = f.up.shape[1]
    w_lat, w_rope = layer.kv_a_proj[:full], layer.kv_a_proj[full:]  # [full, D], [d_r, D]
    b_lat = b_rope = None
    if layer.kv_a_bias is not None:
        b_lat, b_rope = layer.kv_a_bias[:full], layer.kv_a_bias[full:]
    dtype = layer.kv_a_proj.dtype
    D = w_lat.shape[1]
    down_w = f.down[:, :D]  # [R, D]
    kv_a_bias = None
    if f.down.shape[1] == D + 1 and (b_lat is not None or b_rope is not None):
        lat_bias = f.down[:, D]  # [R] = U^T b
        kv_a_bias = torch.cat((lat_bias, b_rope.double() if b_rope is not None else lat_bias.new_zeros(d_r)))
    elif b_rope is not None:
        kv_a_bias = torch.cat((b_rope.new_zeros(rank).double(), b_rope.double()))
    kv_b = layer.kv_b_proj.double()  # [H*(d_nope+d_v), full]
    kv_b_bias = None if f.out_bias is None else kv_b @ f.out_bias  # [H*(d_nope+d_v)]
    if layer.kv_b_bias is not None:
        kv_b_bias = layer.kv_b_bias.double() if kv_b_bias is None else kv_b_bias + layer.kv_b_bias.double()
    return replace(
        layer,
        kv_a_proj=torch.cat((down_w, w_rope.double())).to(dtype),  # [R + d_r, D]
        kv_a_bias=None if kv_a_bias is None else kv_a_bias.to(dtype),
        kv_b_proj=(kv_b @ f.up).to(dtype),  # [H*(d_nope+d_v), R]
        kv_b_bias=None if kv_b_bias is None else kv_b_bias.to(dtype),
    )
