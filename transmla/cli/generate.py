"""transmla generate: text from a model, through its (latent) KV cache."""

from __future__ import annotations

from typing import Annotated

import torch
import typer

from ..checkpoint.resolve import load_model
from ..eval.kv import cache_bytes
from ..mla.model import set_decode_mode
from ..progress import stderr_console
from .common import JsonFlag, emit, pick_device, pick_dtype

Opt = typer.Option


def generate(
    model: Annotated[str, typer.Argument(help="Local folder, .gguf, hub id, a built-in name (smollm2-135m, qwen2.5-coder-1.5b), or a converted model.")],
    prompt: Annotated[str, typer.Argument(help="The prompt text.")],
    max_new_tokens: Annotated[int, Opt(help="Tokens to generate.")] = 32,
    chat: Annotated[bool, Opt("--chat", help="Wrap the prompt in the tokenizer's chat template.")] = False,
    sample: Annotated[bool, Opt("--sample", help="Sample (temperature 0.7) instead of greedy decoding.")] = False,
    decode: Annotated[str, Opt(help="MLA models: absorbed | expanded | auto attention for new tokens.")] = "absorbed",
    dtype: Annotated[str, Opt(help="fp32 | bf16 | fp16.")] = "fp32",
    device: Annotated[str, Opt(help="auto | cpu | cuda.")] = "auto",
    as_json: JsonFlag = False,
) -> None:
    """Generate a continuation; MLA models decode through the latent cache (absorbed by default)."""
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    if not prompt.strip() and not chat:
        raise ValueError("the prompt is empty: give some text to continue (or --chat to answer it)")
    net, tokenizer = load_model(model, dtype=pick_dtype(dtype), device=pick_device(device))
    if getattr(net.config, "mla", None) is not None:
        set_decode_mode(net, decode)
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    else:
        text = prompt
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False).to(net.device)
    if inputs["input_ids"].shape[1] == 0:
        raise ValueError(f"the prompt {prompt!r} gives no tokens: give some text to continue")
    with torch.inference_mode():
        out = net.generate(
            **inputs, max_new_tokens=max_new_tokens, do_sample=sample, temperature=0.7 if sample else None,
            top_p=None, top_k=None, return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id,
        )
    new_tokens = out.sequences[0, inputs["input_ids"].shape[1] :]
    completion = tokenizer.decode(new_tokens, skip_special_tokens=True)
    if as_json:
        emit({"prompt": prompt, "completion": completion, "new_tokens": int(new_tokens.numel()),
              "cache_bytes": cache_bytes(out.past_key_values)}, True, "")
        return
    stderr_console.print(f"[dim]{new_tokens.numel()} tokens; KV cache holds {cache_bytes(out.past_key_values):,} bytes[/dim]")
    print(prompt + completion if not chat else completion)
