"""Perplexity after each stage of a conversion (`transmla convert --eval-data`).

A method that has stages (TransMLA: rorope, freqfold, bkv_pca) hands every layer's form at each
stage to the hook made here, which assembles one model per stage and scores it beside the source.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..convert.assemble import assemble_model
from ..convert.layers import MLALayer
from ..progress import stderr_console

STAGE_WINDOWS, STAGE_SEQ_LEN = 8, 512


def stage_perplexities(source_dir: Path, config, stage_layers: dict[str, list[MLALayer]], ids: torch.Tensor,
                       windows: int = STAGE_WINDOWS, seq_len: int = STAGE_SEQ_LEN, progress: bool = False) -> dict[str, float]:
    """Perplexity of the source and of the partial models (every layer at that stage) on `windows` windows."""
    from ..checkpoint.resolve import load_lm
    from .perplexity import perplexity

    source = load_lm(source_dir)
    out = {"source": perplexity(source, ids, seq_len=seq_len, max_windows=windows, progress=progress).perplexity}
    del source
    for name, layers in stage_layers.items():
        model = assemble_model(source_dir, config, layers, {"name": f"transmla-{name}"})
        out[name] = perplexity(model, ids, seq_len=seq_len, max_windows=windows, progress=progress).perplexity
        del model
    return out


def stage_report(data: str, progress: bool = True):
    """The hook for convert(stage_report=...): scores every stage on `data`'s evaluation part and
    prints one line per stage on stderr."""

    def report(source_dir: Path, config, stage_layers: dict[str, list[MLALayer]]) -> dict[str, float]:
        from transformers import AutoTokenizer

        from ..data.texts import load_text
        from .perplexity import tokenize_text

        tokenizer = AutoTokenizer.from_pretrained(str(source_dir))
        ids = tokenize_text(tokenizer, load_text(data, part="eval"))
        ppl = stage_perplexities(source_dir, config, stage_layers, ids, progress=progress)
        for name, value in ppl.items():
            stderr_console.print(
                f"[bold]{name}[/] perplexity on {data} ({STAGE_WINDOWS} x {STAGE_SEQ_LEN} tokens): {value:.2f}"
            )
        return ppl

    return report
