"""Perplexity after each stage of a conversion (`transmla convert --eval-data`).

A method that has stages (TransMLA: rorope, freqfold, bkv_pca) hands every layer's form at each
stage to the hook made here, which assembles one model per stage and scores it beside the source.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ..convert.assemble import assemble_model
from ..convert.layers import MLALayer
from ..progress import stderr_console

STAGE_WINDOWS, STAGE_SEQ_LEN = 8, 512


def stage_perplexities(source_dir: Path, config, stage_layers: dict[str, list[MLALayer]], ids: torch.Tensor,
                       windows: int = STAGE_WINDOWS, seq_len: int = STAGE_SEQ_LEN, progress: bool = False,
                       probe: Callable | None = None, probes: dict | None = None,
                       with_source: bool = True) -> dict[str, float]:
    """Perplexity of the source and of the partial models (every layer at that stage) on `windows`
    windows; with `probe` (model -> result, e.g. eval/key_probe.py's passkey probe) also each
    model's probe result, written into `probes` under the same names. with_source=False scores the
    stages alone (a caller comparing many conversions of one source scores it once)."""
    from ..checkpoint.resolve import load_lm
    from .perplexity import perplexity

    loaders = {"source": lambda: load_lm(source_dir)} if with_source else {}
    for name, layers in stage_layers.items():
        loaders[name] = lambda layers=layers, name=name: assemble_model(source_dir, config, layers, {"name": f"transmla-{name}"})
    out = {}
    for name, load in loaders.items():
        model = load()
        out[name] = perplexity(model, ids, seq_len=seq_len, max_windows=windows, progress=progress).perplexity
        if probe is not None and probes is not None:
            probes[name] = probe(model)
        del model
    return out


def stage_report(data: str, progress: bool = True, passkey=None, passkey_lengths: list[int] | None = None,
                 probes: dict | None = None, with_source: bool = True):
    """The hook for convert(stage_report=...): scores every stage on `data`'s evaluation part and
    prints one line per stage on stderr. With `passkey` (PasskeySettings) and `passkey_lengths`, also
    the passkey likelihood probe of every stage (eval/key_probe.py), printed and kept in `probes`."""

    def report(source_dir: Path, config, stage_layers: dict[str, list[MLALayer]]) -> dict[str, float]:
        from transformers import AutoTokenizer

        from ..data.texts import load_text
        from .key_probe import key_probe
        from .perplexity import tokenize_text

        tokenizer = AutoTokenizer.from_pretrained(str(source_dir))
        ids = tokenize_text(tokenizer, load_text(data, part="eval"))
        found = probes if probes is not None else {}
        probe = (lambda model: key_probe(model, tokenizer, passkey, passkey_lengths)) if passkey is not None else None
        ppl = stage_perplexities(source_dir, config, stage_layers, ids, progress=progress, probe=probe, probes=found,
                                 with_source=with_source)
        for name, value in ppl.items():
            extra = ""
            if name in found:
                r = found[name]
                extra = f"; passkey probe: key NLL {r['nll']:.3f}, {r['exact']}/{r['keys']} exact"
            stderr_console.print(
                f"[bold]{name}[/] perplexity on {data} ({STAGE_WINDOWS} x {STAGE_SEQ_LEN} tokens): {value:.2f}{extra}"
            )
        return ppl

    return report
