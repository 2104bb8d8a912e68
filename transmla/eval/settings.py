"""The evaluation protocol, one schema for `eval`, `sweep` and the benchmarks (flags derived in cli/)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..dtypes import pick_device, torch_dtype
from ..schema import option


@dataclass
class EvalSettings:
    """One protocol for every model of a report or sweep."""

    data: str = option("wiki", "Evaluation text: wiki | lee | code (built-in evaluation parts), a .txt/.jsonl PATH, "
                       "or a dataset name[:config[:split]].")
    text_field: str = option("text", "Field holding the text in JSONL / datasets.")
    seq_len: int = option(512, "Tokens per window.")
    max_windows: int | None = option(None, "Evaluate at most this many windows.")
    stride: int | None = option(None, "Sliding-window protocol with this stride (default: non-overlapping).")
    batch_size: int = option(4, "Windows per forward pass.")
    dtype: str = option("fp32", "fp32 | bf16 | fp16, for evaluation.")
    device: str = option("auto", "auto | cpu | cuda.")
    context: int | None = option(8192, "Report the KV cache size at this many tokens.")
    measure_tokens: int = option(0, "Generate this many tokens per model and measure the cache (0: skip).",
                                 flag="--measure-cache")
    prompt_tokens: int = 32  # prompt for the measured cache: the first tokens of the text
    progress: bool = True

    def __post_init__(self) -> None:
        """Checked before any model loads (one-line errors naming the setting)."""
        if self.seq_len < 2:
            raise ValueError(f"seq_len must be at least 2, got {self.seq_len}")
        if self.max_windows is not None and self.max_windows < 1:
            raise ValueError(f"max_windows must be at least 1, got {self.max_windows}")
        if self.stride is not None and not 1 <= self.stride <= self.seq_len:
            raise ValueError(f"stride must be between 1 and seq_len ({self.seq_len}), got {self.stride}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {self.batch_size}")
        self.device = pick_device(self.device)
        torch_dtype(self.dtype)  # fail early on a bad name
        if self.context is not None and self.context < 1:
            raise ValueError(f"context must be positive, got {self.context}")
        if self.measure_tokens < 0:
            raise ValueError(f"measure_tokens must be 0 or more, got {self.measure_tokens}")

    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


__all__ = ["EvalSettings"]
