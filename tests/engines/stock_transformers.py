"""Run exported folders in stock transformers, in a process that never imports transmla.

usage: python stock_transformers.py IDS.safetensors OUT_DIR FOLDER [FOLDER ...]
For each folder: prefill logits of all ids, then the same ids token by token through the model's
own cache (decode), saved to OUT_DIR/<i>.safetensors; one JSON line per folder on stdout with the
model class and the shapes of what the cache holds for layer 0.
"""

import json
import sys

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM


def run(folder: str, ids: torch.Tensor) -> tuple[dict, dict]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        prefill = model(ids).logits  # [B, T, V]
        out = model(ids[:, :1], use_cache=True)
        cache, steps = out.past_key_values, [out.logits[:, -1]]
        for t in range(1, ids.shape[1]):
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits[:, -1])
    layer = cache.layers[0]
    info = {
        "class": type(model).__name__,
        "transformers": transformers.__version__,
        "cache_keys": list(layer.keys.shape),
        "cache_values": list(layer.values.shape),
        "cache_layers": len(cache.layers),
    }
    return info, {"prefill": prefill.contiguous(), "decode": torch.stack(steps, 1).contiguous()}


def main() -> None:
    ids = load_file(sys.argv[1])["ids"]
    out_dir = sys.argv[2]
    for i, folder in enumerate(sys.argv[3:]):
        info, tensors = run(folder, ids)
        save_file(tensors, f"{out_dir}/{i}.safetensors")
        info["transmla_imported"] = any(m == "transmla" or m.startswith("transmla.") for m in sys.modules)
        print(json.dumps(info), flush=True)


if __name__ == "__main__":
    main()
