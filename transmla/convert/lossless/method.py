"""Lossless: key/value replication, exact, no cache saving (ALGORITHMS.md, lossless)."""

from __future__ import annotations

from ..method import ConversionMethod
from ..replicate import replicate


class Lossless(ConversionMethod):
    name = "lossless"
    help = "exact, no saving"

    def convert_layer(self, plan, source, stats):
        return replicate(source), {}

    def shared_rope(self, geometry, options):
        g = geometry.num_kv_heads
        if g > 1:
            raise ValueError(
                f"shared_rope: lossless keeps the rope pairs of all {g} KV heads (each frequency {g} times), "
                "which no shared rope grid represents; use method transmla"
            )
        return options
