"""Rank-R factorisations of a linear map W [out, in]: W ~= up @ down.

One routine serves both published methods:
- weight SVD (MHA2MLA "none"): minimise ||W - W_hat||_F; this is the case gram = I.
- activation-aware (MHA2MLA "activation", TransMLA's joint PCA): minimise E||(W - W_hat) x||^2
  with C = E[x x^T]. The optimum projects onto the top eigenvectors U_R of the output
  covariance W C W^T (Eckart-Young on W C^(1/2)): up = U_R, down = U_R^T W. PCA of the
  activations y = W x is exactly this, so TransMLA's "PCA on [K_nope; V] activations" and
  MHA2MLA's whitened SVD coincide (up to TransMLA's BKV rescaling, applied before).
Biases ride along as an extra input column of constant 1 (augmented gram).
All in float64; eigenvalues are returned so callers can share a rank across blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Factorization:
    up: torch.Tensor  # [out, R]
    down: torch.Tensor  # [R, in]
    energy: torch.Tensor  # [out] eigenvalues of the output covariance, descending

    @property
    def rank(self) -> int:
        return self.up.shape[1]


def output_covariance(w: torch.Tensor, gram: torch.Tensor | None) -> torch.Tensor:
    """W C W^T (float64); C = I when gram is None."""
    w = w.double()
    return w @ w.T if gram is None else w @ gram.double() @ w.T


def principal_basis(cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvectors (columns) and eigenvalues of a symmetric (or Hermitian) PSD matrix, descending."""
    cov = 0.5 * (cov + cov.mH)
    evals, evecs = torch.linalg.eigh(cov)
    order = torch.argsort(evals, descending=True)
    return evecs[:, order], evals[order].clamp_min(0)


def low_rank(w: torch.Tensor, rank: int, gram: torch.Tensor | None = None) -> Factorization:
    """Best rank-`rank` W ~= up @ down in the gram-weighted norm (Frobenius when gram is None).

    w [out, in] (in may include a bias column), gram [in, in] = E[x x^T] or None.
    At rank = out the factorisation is exact: up is orthogonal and up @ down = W.
    """
    out = w.shape[0]
    if not 0 <= rank <= out:
        raise ValueError(f"rank {rank} does not fit a map with {out} outputs")
    basis, energy = principal_basis(output_covariance(w, gram))
    up = basis[:, :rank]  # [out, R]
    return Factorization(up=up, down=up.T @ w.double(), energy=energy)


def with_bias_column(w: torch.Tensor, b: torch.Tensor | None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[W | b] (in `dtype`, default W's): the map acting on the augmented input [x; 1]; zeros without a bias."""
    w = w if dtype is None else w.to(dtype)
    bias = w.new_zeros(w.shape[0]) if b is None else b.to(w.dtype)
    return torch.cat((w, bias[:, None]), dim=1)
