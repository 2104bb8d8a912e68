"""KV-cache accounting: what a transformers Cache really holds, next to the formula."""

from __future__ import annotations


def cache_elements(cache) -> int:
    """Elements held by a transformers Cache (all layers, keys and values)."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if t is not None:
                total += t.numel()
    return total


def cache_bytes(cache) -> int:
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if t is not None:
                total += t.numel() * t.element_size()
    return total
