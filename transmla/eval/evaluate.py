"""Evaluate one model under one protocol (eval/settings.py), alone or beside its source.

``evaluate_model`` is the one evaluation ``transmla eval`` (with ``--compare``), ``transmla
sweep`` and the benchmarks use: perplexity on a text, KV accounting at a context, and optionally
the cache measured after generating tokens.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..machine import environment
from ..messages import warn
from . import report as rep
from .perplexity import PerplexityResult
from .settings import EvalSettings

__all__ = ["EvalSettings", "Evaluated", "compare_report", "evaluate_model"]


@dataclass
class Evaluated:
    entry: rep.ModelEntry  # a dict only when written (to_dict)
    ids: torch.Tensor  # [N] the evaluation tokens
    ppl: PerplexityResult  # a dict only when written (to_dict)


def evaluate_model(spec: str | Path, settings: EvalSettings, role: str = "model",
                   ids: torch.Tensor | None = None) -> Evaluated:
    """Load ``spec`` (source or converted), score the text, account for (and measure) its KV cache.

    ``ids`` [N], when given, must equal this model's own tokenization of the text (a comparison
    needs the same tokens): a model with another tokenizer is refused.
    """
    from ..checkpoint.resolve import load_model
    from ..data.texts import load_text
    from .kv import kv_summary
    from .measured_cache import measure_cache
    from .perplexity import perplexity, tokenize_text

    dtype = settings.torch_dtype()
    net, tokenizer = load_model(str(spec), dtype=dtype, device=settings.device)
    try:
        limit = getattr(net.config, "max_position_embeddings", None)
        if limit is not None and settings.seq_len > limit:
            warn(f"--seq-len {settings.seq_len} is longer than {spec}'s {limit} positions (max_position_embeddings): "
                 "perplexity past them measures extrapolation, not the model")
        own = tokenize_text(tokenizer, load_text(settings.data, part="eval", text_field=settings.text_field))  # [N]
        if ids is not None and not torch.equal(own, ids):
            raise ValueError(f"{spec} tokenizes the text differently from the model it is compared with")
        start, cpu = time.perf_counter(), time.process_time()
        result = perplexity(net, own, seq_len=settings.seq_len, max_windows=settings.max_windows,
                            stride=settings.stride, batch_size=settings.batch_size, progress=settings.progress)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
        measured = None
        if settings.measure_tokens > 0:
            prompt = own[: max(1, min(settings.prompt_tokens, own.numel()))]  # [P]
            measured = measure_cache(net, prompt, settings.measure_tokens)
        kv = kv_summary(net.config, dtype, settings.context)
        entry = rep.model_entry(str(spec), role, kv, result, measured, seconds)
        entry.eval_cpu_seconds = cpu_seconds  # all threads of this process; wall time is inflated on a shared CPU
        if kv.method is None and kv.attention == "MLA":
            entry.method = "mla"
        return Evaluated(entry, own, result)
    finally:
        del net
        gc.collect()


def compare_report(evaluated: Sequence[Evaluated], settings: EvalSettings, command: str | None = None) -> dict[str, Any]:
    """The report of one or two models (the source first when comparing), one protocol."""
    models = [e.entry.to_dict() for e in evaluated]
    report: dict[str, Any] = {
        "protocol": rep.protocol_info(evaluated[0].ppl, settings.data, settings.text_field),
        "context": settings.context,
        "dtype": settings.dtype,
        "models": models,
        "comparison": rep.comparison(models[-1], models[0]) if len(models) == 2 else None,
        "settings": settings.to_dict(),
        "environment": environment(),
        "command": command or rep.command_line(),
    }
    return report
