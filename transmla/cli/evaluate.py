"""transmla eval: perplexity of a source or converted model on a text."""

from __future__ import annotations

from typing import Annotated

import typer

from ..checkpoint.resolve import load_model
from ..data.texts import load_text
from ..eval.kv import kv_summary
from ..eval.perplexity import perplexity, tokenize_text
from .common import JsonFlag, emit, pick_device, pick_dtype

Opt = typer.Option


def evaluate(
    model: Annotated[str, typer.Argument(help="Local folder, .gguf, hub id, 'smollm2-135m', or a converted model.")],
    data: Annotated[str, Opt(help="wiki | lee (built-in evaluation parts), a .txt/.jsonl PATH, or a dataset name.")] = "wiki",
    seq_len: Annotated[int, Opt(help="Tokens per window.")] = 512,
    max_windows: Annotated[int | None, Opt(help="Evaluate at most this many windows.")] = None,
    stride: Annotated[int | None, Opt(help="Sliding-window protocol with this stride (default: non-overlapping).")] = None,
    text_field: Annotated[str, Opt(help="Field holding the text in JSONL / datasets.")] = "text",
    batch_size: Annotated[int, Opt(help="Windows per forward pass.")] = 4,
    dtype: Annotated[str, Opt(help="fp32 | bf16 | fp16.")] = "fp32",
    device: Annotated[str, Opt(help="auto | cpu | cuda.")] = "auto",
    as_json: JsonFlag = False,
) -> None:
    """Token-level perplexity, exp(mean NLL), over windows of the evaluation text."""
    torch_dtype = pick_dtype(dtype)
    net, tokenizer = load_model(model, dtype=torch_dtype, device=pick_device(device))
    ids = tokenize_text(tokenizer, load_text(data, part="eval", text_field=text_field))
    result = perplexity(net, ids, seq_len=seq_len, max_windows=max_windows, stride=stride, batch_size=batch_size)
    kv = kv_summary(net.config, torch_dtype)
    emit(
        {
            "model": model,
            "data": data,
            **result.to_dict(),
            "kv_elements_per_token_per_layer": kv["kv_elements_per_token_per_layer"],
            "kv_bytes_per_token": kv["kv_bytes_per_token"],
            "attention": kv["attention"],
        },
        as_json,
        "perplexity",
    )
