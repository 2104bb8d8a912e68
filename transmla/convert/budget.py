"""The KV budget: the fraction of the source's KV cache a conversion keeps.

One range, (0, 1): a budget of 1 or more saves nothing (method lossless keeps the whole cache), and
one rounding, down, so a conversion never caches more than the budget it was given. The convert
options, every method and the sweep check budgets here. A leaf module: it imports nothing of the
package, so the methods and the options can both use it without importing each other.
"""

from __future__ import annotations

import math


def check_kv_budget(kv_budget: float | None) -> None:
    """A one-line error for a budget outside (0, 1); None (no budget given) passes."""
    if kv_budget is None:
        return
    if isinstance(kv_budget, bool) or not isinstance(kv_budget, (int, float)) or not math.isfinite(kv_budget) \
            or not 0 < kv_budget < 1:
        raise ValueError(
            f"kv_budget is the fraction of the source's KV cache to keep, between 0 and 1 (exclusive), "
            f"got {kv_budget!r}; method lossless keeps all of it"
        )


def budget_elements(kv_budget: float, source_kv_elements: int) -> int:
    """Cached elements per token per layer that the budget allows, rounded down (the 1e-9 keeps
    products like 0.3 * 10 = 2.9999999999999996 at 3)."""
    check_kv_budget(kv_budget)
    return math.floor(kv_budget * source_kv_elements + 1e-9)


__all__ = ["budget_elements", "check_kv_budget"]
