"""One check that a tensor holds only finite numbers, for every tensor we read, compute or write."""

from __future__ import annotations

import torch


class NonFiniteError(ValueError):
    """A tensor (weights, statistics, a loss) holds NaN or Inf."""


def require_finite(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """Return ``tensor`` unchanged, or raise NonFiniteError naming ``what`` and counting the bad values."""
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return tensor
    try:
        finite = torch.isfinite(tensor)
    except (RuntimeError, NotImplementedError):  # float8 kinds without an isfinite kernel
        finite = torch.isfinite(tensor.float())
    if bool(finite.all()):
        return tensor
    bad = int((~finite).sum())
    raise NonFiniteError(f"{what} has {bad} non-finite value{'s' if bad != 1 else ''} (NaN or Inf) of {tensor.numel()}")


def require_finite_number(value: float, what: str) -> float:
    """The same check for one number (a loss, a perplexity)."""
    if value != value or value in (float("inf"), float("-inf")):
        raise NonFiniteError(f"{what} is {value}: the model produced NaN or Inf")
    return value
