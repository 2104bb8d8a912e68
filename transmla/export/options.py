"""Export settings, declared once: `transmla export`, `convert --format deepseek` (whose output
settings extend these, convert/options.py) and the library take this dataclass; the CLI derives
the flags and their help from its fields (schema.option, cli/options.py). Errors name fields."""

from __future__ import annotations

from dataclasses import dataclass

from ..dtypes import torch_dtype
from ..schema import option
from .engines import VLLM_MLA_WIDTHS, parse_engines
from .errors import ExportError


@dataclass
class ExportOptions:
    engines: str = option(
        "transformers", "DeepSeek export: engines it must load in exactly, comma-separated: transformers, vllm, "
        "sglang or all (their rules are checked, before converting where the source decides them; "
        "`transmla inspect OUTPUT` reports every engine).",
    )
    pad_latent: bool = option(
        False, "DeepSeek export: zero-pad the latent so kv_lora_rank + qk_rope_head_dim is a width vLLM accepts "
        "(320 or 576): exact, but the cache grows to that width.",
    )
    pad_width: int | None = option(
        None, "With --pad-latent: the width to pad kv_lora_rank + qk_rope_head_dim to, 320 or 576 (default: the "
        "smallest that holds the latent). 576 is the one width vLLM's FlashMLA, CUTLASS and CPU MLA backends take; "
        "320 only its Triton MLA backend.",
    )
    pad_value: bool = option(
        False, "DeepSeek and GGUF export: zero-pad each head's value to its key's width (v_head_dim = "
        "qk_nope_head_dim + qk_rope_head_dim), a pair engines' prompt attention kernels take (ik_llama.cpp's flash "
        "attention, vLLM's prefill): exact, the cache unchanged, kv_b and o_proj wider.",
    )
    drop_biases: bool = option(
        False, "Drop attention biases for engines without them (vLLM, SGLang, llama.cpp): lossy, measure it.",
    )
    dtype: str | None = option(
        None, "Output dtype: fp32 | bf16 | fp16 (default: the model's; a DeepSeek export refuses fp16, which "
        "underflows its latent-norm scaling).",
    )
    max_shard_size: str = option("5GB", "Largest safetensors shard, e.g. 5GB, 500MB.")
    force: bool = option(False, "Replace a non-empty output folder.")

    def __post_init__(self) -> None:
        from ..checkpoint.writer import parse_size

        parse_engines(self.engines)
        if self.pad_width is not None:
            if not self.pad_latent:
                raise ValueError("pad_width applies only with pad_latent")
            if self.pad_width not in VLLM_MLA_WIDTHS:
                raise ValueError(f"pad_width must be one of {', '.join(map(str, VLLM_MLA_WIDTHS))}, got {self.pad_width}")
        if self.dtype is not None:
            torch_dtype(self.dtype)  # fail before any work on a bad name
        parse_size(self.max_shard_size)

    @property
    def engine_names(self) -> tuple[str, ...]:
        """`engines` as engine names, in the order given ("all": every engine)."""
        return parse_engines(self.engines)

    def refuse_fp16(self) -> None:
        """The DeepSeek export's refusal of --dtype fp16, before any work."""
        if self.dtype == "fp16":
            raise ExportError(
                "fp16 cannot hold the scaled latent rows that make the latent RMSNorm a no-op "
                "(they underflow); export as fp32 or bf16"
            )


__all__ = ["ExportOptions"]
