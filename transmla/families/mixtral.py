import re

import torch

from .base import Family, MoERouting

_EXPERT = re.compile(r"block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight")


def fuse_experts(tensors: dict) -> dict:
    """Legacy per-expert w1/w2/w3 -> transformers 5's fused experts (gate_up_proj, down_proj).

    gate_up_proj [E, 2I, D] = cat(w1, w3) per expert; down_proj [E, D, I] = w2 per expert.
    """
    out, experts = {}, {}
    for name, t in tensors.items():
        m = _EXPERT.fullmatch(name)
        if m:
            experts.setdefault(m.group(2), {})[int(m.group(1))] = t
        else:
            out[name.replace("block_sparse_moe.", "mlp.")] = t
    if experts:
        n = len(experts["w1"])
        out["mlp.experts.gate_up_proj"] = torch.stack([torch.cat((experts["w1"][e], experts["w3"][e])) for e in range(n)])
        out["mlp.experts.down_proj"] = torch.stack([experts["w2"][e] for e in range(n)])
    return out


_FUSED = re.compile(r"(?:block_sparse_moe|mlp)\.experts\.(gate_up_proj|down_proj)")
_DEEPSEEK_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def deepseek_moe_tensors(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
    """One layer's MoE tensor (layer prefix stripped) under DeepSeek's names, or None if `name` is
    not part of the MoE. Per-expert w1/w3/w2 are renamed (gate/up/down_proj); transformers 5's fused
    gate_up_proj [E, 2I, D] and down_proj [E, D, I] are split per expert."""
    if name in ("block_sparse_moe.gate.weight", "mlp.gate.weight"):
        # DeepSeek's shared expert, zero-wide (n_shared_experts 0): engines still build it, and vLLM's
        # loader refuses a checkpoint without its (empty) weights.
        D = tensor.shape[1]
        return [("mlp.gate.weight", tensor),
                ("mlp.shared_experts.gate_proj.weight", tensor.new_zeros(0, D)),
                ("mlp.shared_experts.up_proj.weight", tensor.new_zeros(0, D)),
                ("mlp.shared_experts.down_proj.weight", tensor.new_zeros(D, 0))]
    m = _EXPERT.fullmatch(name)
    if m:
        return [(f"mlp.experts.{m.group(1)}.{_DEEPSEEK_EXPERT[m.group(2)]}.weight", tensor)]
    m = _FUSED.fullmatch(name)
    if m is None:
        return None
    if m.group(1) == "down_proj":
        return [(f"mlp.experts.{e}.down_proj.weight", w) for e, w in enumerate(tensor)]
    inter = tensor.shape[1] // 2
    return [(f"mlp.experts.{e}.{part}.weight", w[rows]) for e, w in enumerate(tensor)
            for part, rows in (("gate_proj", slice(0, inter)), ("up_proj", slice(inter, None)))]


# The sparse MoE MLP is copied through untouched; only attention changes.
FAMILY = Family(
    model_type="mixtral",
    config_class="MixtralConfig",
    decoder_layer_class="MixtralDecoderLayer",
    causal_lm_class="MixtralForCausalLM",
    layer_weight_adapter=fuse_experts,
    # Softmax over all experts, the top k kept and renormalised to sum to one.
    moe=MoERouting(experts_key="num_local_experts", scoring_func="softmax", renormalize=True,
                   deepseek_tensors=deepseek_moe_tensors),
    notes="MoE MLP untouched",
)
