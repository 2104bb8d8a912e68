"""One check that a tensor holds only finite numbers, for every tensor we read, compute or write."""

from __future__ import annotations

import torch


_CHUNK = 2**22


def _isfinite(tensor: torch.Tensor) -> torch.Tensor:
    try:
        return torch.isfinite(tensor)
    except (RuntimeError, NotImplementedError):  # float8 kinds without an isfinite kernel
        return torch.isfinite(tensor.float())


class NonFiniteError(ValueError):
    """A tensor (weights, statistics, a loss) holds NaN or Inf."""


def require_finite(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """Return ``tensor`` unchanged, or raise NonFiniteError naming ``what`` and counting the bad values."""
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return tensor
    # Checked a slice at a time: isfinite's temporaries on a whole embedding cost over 1 GB.
    flat = tensor.reshape(-1) if tensor.is_contiguous() else tensor.flatten()
    if all(bool(_isfinite(part).all()) for part in flat.split(_CHUNK)):
        return tensor
    bad = sum(int((~_isfinite(part)).sum()) for part in flat.split(_CHUNK))
    raise NonFiniteError(f"{what} has {bad} non-finite value{'s' if bad != 1 else ''} (NaN or Inf) of {tensor.numel()}")


def require_finite_number(value: float, what: str) -> float:
    """The same check for one number (a loss, a perplexity)."""
    if value != value or value in (float("inf"), float("-inf")):
        raise NonFiniteError(f"{what} is {value}: the model produced NaN or Inf")
    return value
