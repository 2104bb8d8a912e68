"""Training path of MLAAttention: recompute the K/V up-projection in the backward pass.

Expand-then-attend (MLAAttention._expanded) builds, per token, every head's key and value from
the latent: K = [W_UK c | k_r] [B, S, H, d_nope + d_r] and V = W_UV c [B, S, H, d_v] — H times
the width of what the cache holds (d_c + d_r). Autograd keeps K and V (and SDPA keeps them for
its own backward) for every layer until the backward pass. With ``enable_kv_recompute`` the
expansion and the attention run under activation checkpointing instead: the forward keeps only
its inputs (q_nope, q_rope, the latent c, the rotated rope key k_r, the mask), and the backward
rebuilds K, V and the attention from them. Same values and gradients (tested), less activation
memory, one more kv_b_proj and attention forward per layer in the backward pass.

Implemented by patching the instance: ``module._expanded`` is replaced by a checkpointed call
of the class's own method, so attention.py stays unchanged. Active only while the module is in
training mode with gradients enabled; evaluation and decoding are untouched.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

from .attention import MLAAttention

__all__ = ["disable_kv_recompute", "enable_kv_recompute", "kv_recompute_enabled"]

_FLAG = "_transmla_kv_recompute"


def _checkpointed_expanded(module: MLAAttention, q_nope, q_rope, latent, k_rope, mask):
    expand = functools.partial(MLAAttention._expanded, module)
    if module.training and q_nope.requires_grad | latent.requires_grad | k_rope.requires_grad:
        # Saved for backward: the inputs only; K, V [B, S, H, .] are rebuilt there.
        return checkpoint(expand, q_nope, q_rope, latent, k_rope, mask, use_reentrant=False)
    return expand(q_nope, q_rope, latent, k_rope, mask)


def enable_kv_recompute(model: nn.Module) -> int:
    """Recompute K/V expansion + attention in the backward pass of every MLAAttention; returns how many."""
    count = 0
    for module in model.modules():
        if isinstance(module, MLAAttention):
            module._expanded = functools.partial(_checkpointed_expanded, module)
            setattr(module, _FLAG, True)
            count += 1
    return count


def disable_kv_recompute(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, MLAAttention) and getattr(module, _FLAG, False):
            del module._expanded
            delattr(module, _FLAG)


def kv_recompute_enabled(module: nn.Module) -> bool:
    return any(getattr(m, _FLAG, False) for m in module.modules())
