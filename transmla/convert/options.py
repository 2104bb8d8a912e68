"""Every conversion setting, validated once; the CLI fills it, the methods read it."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class ConvertOptions:
    method: str = "lossless"  # lossless | transmla | mha2mla
    # Cache shape. transmla: R + r; mha2mla: R + n_kv * 2P. --kv-budget derives them.
    kv_lora_rank: int | None = None  # R (d_c)
    rope_dim: int | None = None  # r (d_r), transmla
    rope_pairs: int | None = None  # P per KV head, mha2mla
    kv_budget: float | None = None  # fraction of the source cache
    freqfold: str = "auto"  # an integer, "auto" (F = d/r) or "logit" (transmla)
    rope_select: str = "high"  # high | low | uniform | 2norm (mha2mla)
    svd: str = "joint"  # joint | split (mha2mla)
    svd_weighting: str = "activation"  # activation (ours: whiten by the input covariance) | none (published)
    q_lora_rank: int | None = None
    shared_rope: bool = False  # one rope frequency grid in every layer (exportable to DeepSeek/GGUF)
    format: str = "native"  # native | deepseek (convert, then export; implies shared_rope)
    # Calibration.
    calib: str = "wiki"
    calib_samples: int | None = None  # None: the method's default (calibration_size)
    calib_seq_len: int | None = None
    seed: int = 0
    propagate: str | None = None  # later layers calibrated on original | converted earlier layers (None: the method's default)
    eval_data: str | None = None  # print perplexity after each stage
    # Output.
    dtype: str | None = None  # fp32 | bf16 | fp16 (default: the source's)
    device: str = "auto"
    max_shard_size: str = "5GB"
    force: bool = False

    def to_dict(self) -> dict:
        return asdict(self)

    def calibration_size(self, default: tuple[int, int]) -> tuple[int, int]:
        """(sequences, tokens per sequence): the ones given, else the method's `default`."""
        n = default[0] if self.calib_samples is None else self.calib_samples
        t = default[1] if self.calib_seq_len is None else self.calib_seq_len
        return n, t

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
