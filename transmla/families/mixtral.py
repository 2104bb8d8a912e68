import re

import torch

from .base import Family

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


# The sparse MoE MLP is copied through untouched; only attention changes.
FAMILY = Family(
    model_type="mixtral",
    config_class="MixtralConfig",
    decoder_layer_class="MixtralDecoderLayer",
    causal_lm_class="MixtralForCausalLM",
    layer_weight_adapter=fuse_experts,
    notes="MoE MLP untouched",
)
