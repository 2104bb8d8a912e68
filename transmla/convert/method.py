"""What a conversion method is: one object the pipeline drives, layer by layer.

A method declares its settings (`Options`, a dataclass whose fields become CLI flags and recipe
keys), its default calibration, and which calibration statistics a plan reads; it turns the
settings into a `plan` for one source geometry and converts one source layer at a time. The
pipeline (pipeline.py) owns everything else: calibration tokens, the iteration, the meta record
written into config.json. Methods are listed in registry.py.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, is_dataclass
from typing import Any, ClassVar

from ..families import AttentionGeometry
from .layers import MLALayer, SourceAttention


@dataclass(frozen=True)
class StatsNeeds:
    """The calibration statistics a plan reads (calibrate.LayerStats)."""

    gram: bool = False  # E[[x;1][x;1]^T] of the attention input
    pair_norms: bool = False  # mean 2-norm of every query/key rope pair

    @property
    def calibration(self) -> bool:
        return self.gram or self.pair_norms


@dataclass
class NoOptions:
    """A method without settings."""


class ConversionMethod:
    """Base of every conversion method; subclasses set the class attributes and override
    `plan` and `convert_layer` (and `needs`, `describe`, `stage_layers`, `summarize` when they have them)."""

    name: ClassVar[str]
    help: ClassVar[str]  # one line for `--method` help
    Options: ClassVar[type] = NoOptions  # its settings (a dataclass; fields default to the method's defaults)
    default_calibration: ClassVar[tuple[int, int]] = (2048, 16)  # sequences x tokens per sequence
    default_propagate: ClassVar[str] = "original"  # calibrate later layers on the original model
    default_fit_steps: ClassVar[int] = 0  # output-aware fit (output_fit.py): Adam steps per layer, 0 = off

    def plan(self, geometry: AttentionGeometry, options: Any) -> Any:
        """Every choice of one conversion of a source with this geometry; ValueError for bad settings."""
        return options

    def needs(self, plan: Any) -> StatsNeeds:
        return StatsNeeds()

    def describe(self, plan: Any) -> dict:
        """What the plan is, for config.json's "mla.method" block (the pipeline adds the rest)."""
        return {"plan": asdict(plan)} if is_dataclass(plan) and asdict(plan) else {}

    def cache_elements(self, plan: Any) -> int | None:
        """KV-cache elements per token per layer the plan keeps (None: the method does not say)."""
        return None

    def shared_rope(self, geometry: AttentionGeometry, options: Any) -> Any:
        """The settings whose conversion has one rope frequency grid in every layer (what DeepSeek
        engines and llama.cpp run; convert --format deepseek asks for it), or ValueError saying why none."""
        raise ValueError(f"{self.name} cannot keep one shared rope grid")

    def convert_layer(self, plan: Any, source: SourceAttention, stats) -> tuple[MLALayer, dict]:
        """One source layer -> (MLA layer, JSON-safe info). stats: calibrate.LayerStats or None."""
        raise NotImplementedError

    def stage_layers(self, plan: Any, source: SourceAttention, stats) -> dict[str, MLALayer]:
        """Intermediate forms of one layer by stage name, for `--eval-data` (none by default)."""
        return {}

    def summarize(self, geometry: AttentionGeometry, plan: Any, infos: list[dict], seconds: float) -> None:
        """Print a summary of the finished conversion to stderr (nothing by default)."""


__all__ = ["ConversionMethod", "NoOptions", "StatsNeeds"]
