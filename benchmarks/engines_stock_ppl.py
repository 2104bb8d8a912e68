"""Perplexity of model folders in a plain transformers process (the bench's engine side).

    python benchmarks/engines_stock_ppl.py WINDOWS.safetensors FOLDER [FOLDER ...] [--import-transmla]

WINDOWS.safetensors holds "<text>" tensors [N, 512] of token ids: every window is scored on its
own (tokens 1..511 given the ones before; ANCHORS.md's protocol). Prints one JSON line per
folder: {text: {"ppl", "nll", "tokens"}}, plus whether transmla was imported. Without
--import-transmla the process never imports it: that is how a user of stock transformers runs
an exported folder. With it, native converted folders load through the same code.
"""

import json
import math
import sys

import torch
from safetensors.torch import load_file


def window_nll(model, windows: torch.Tensor) -> tuple[float, int]:
    total, count = 0.0, 0
    with torch.no_grad():
        for row in windows:
            logits = model(row[None]).logits[0, :-1].float()  # [T-1, V]
            total += float(torch.nn.functional.cross_entropy(logits, row[1:], reduction="sum"))
            count += row.numel() - 1
    return total, count


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if "--import-transmla" in sys.argv:
        import transmla  # noqa: F401
    from transformers import AutoModelForCausalLM

    torch.set_grad_enabled(False)
    texts = load_file(args[0])
    for folder in args[1:]:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        out = {}
        for name, windows in texts.items():
            nll, tokens = window_nll(model, windows)
            out[name] = {"ppl": math.exp(nll / tokens), "nll": nll / tokens, "tokens": tokens}
        out["class"] = type(model).__name__
        out["transmla_imported"] = "transmla" in sys.modules
        print(json.dumps(out), flush=True)
        del model


if __name__ == "__main__":
    main()
