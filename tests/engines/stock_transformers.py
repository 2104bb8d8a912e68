"""Run exported folders in stock transformers, in a process that never imports transmla.

usage: python stock_transformers.py IDS.safetensors OUT_DIR FOLDER [FOLDER ...]
For each folder: prefill logits of all ids, then the same ids token by token through the model's
own cache (decode), saved to OUT_DIR/<i>.safetensors; one JSON line per folder on stdout with the
model class and the shapes of what the cache holds for layer 0.

A sparse-MoE export with `scoring_func: softmax` targets vLLM, whose DeepSeek MoE reads that field
(softmax over all experts, top k, renormalised when norm_topk_prob), while stock transformers'
DeepseekV3 always scores with a sigmoid. For those folders only the router is replaced by vLLM's
rule; every other module (MLA attention, rope, norms, experts, the zero-width shared expert,
weight loading) stays stock.
"""

import json
import sys

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM


def vllm_softmax_router(self, hidden_states):
    """vLLM's DeepseekV2MoE routing with scoring_func softmax, n_group 1 and no correction bias."""
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    router_logits = torch.nn.functional.linear(hidden_states.float(), self.weight.float())  # [N, E]
    scores = router_logits.softmax(dim=-1)
    topk_weights, topk_indices = torch.topk(scores, k=self.top_k, dim=-1)  # [N, k]
    if self.norm_topk_prob:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return router_logits, topk_weights * self.routed_scaling_factor, topk_indices


def run(folder: str, ids: torch.Tensor) -> tuple[dict, dict]:
    config = json.load(open(f"{folder}/config.json"))
    router = "stock"
    if config.get("scoring_func") == "softmax":
        from transformers.models.deepseek_v3 import modeling_deepseek_v3

        modeling_deepseek_v3.DeepseekV3TopkRouter.forward = vllm_softmax_router
        router = "vllm softmax"
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
        "router": router,
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
