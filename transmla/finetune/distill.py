"""train.objective distill: the converted model (the student) learns the next-token distribution
of the unconverted source (the teacher) on the training text.

Per scored token (a label that is not IGNORE: no padding, no document boundary, as the LM loss
scores them) the loss is KL(p_t || p_s) = sum_v p_t(v) (log p_t(v) - log p_s(v)), both
distributions softened by the temperature T (softmax(logits / T)), computed in fp32 from the
logits. Its gradient shrinks as 1/T^2, so it is scaled by T^2 (Hinton et al. 2015, "Distilling the
knowledge in a neural network", section 2) and mixed with the NLL as
alpha * T^2 * KL + (1 - alpha) * NLL. The teacher runs without gradients, in eval mode, on the
student's device, in bf16 when the training precision is bf16; it is never saved in checkpoints.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .data import IGNORE
from .recipe import DistillSpec

__all__ = ["distill_objective", "load_teacher", "scored_kl_sum", "scored_nll_sum", "token_kl"]


def load_teacher(spec: str, dtype: torch.dtype, device: torch.device, vocab_size: int, seq_len: int) -> torch.nn.Module:
    """The source model ``spec`` (a folder, .gguf, hub id or built-in name), frozen, in eval mode.
    A teacher with a sliding window shorter than the training sequences is refused: the trainer's
    4-D document mask reaches its attention as is, which then ignores the window (transformers'
    mask preprocessing passes a 4-D mask through), so it would not be the source's distribution."""
    from ..checkpoint.resolve import load_lm

    teacher = load_lm(spec, dtype=dtype, device=device)
    config = teacher.config
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    if window and window < seq_len:
        raise ValueError(f"distill.teacher {spec} attends within a sliding window of {window} tokens, shorter than "
                         f"data.seq_len {seq_len}: set data.seq_len to at most {window}")
    if teacher.config.vocab_size != vocab_size:
        raise ValueError(
            f"distill.teacher {spec} has a vocabulary of {teacher.config.vocab_size} tokens, "
            f"the model being trained {vocab_size}: the KL needs the same vocabulary"
        )
    teacher.config.use_cache = False
    return teacher.requires_grad_(False)


def token_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(softmax(t / T) || softmax(s / T)) per row, in fp32: logits [N, V] -> [N]."""
    log_p_s = F.log_softmax(student_logits.float() / temperature, dim=-1)  # [N, V]
    log_p_t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)  # [N, V]
    return (log_p_t.exp() * (log_p_t - log_p_s)).sum(-1)  # [N]


def scored_kl_sum(student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor,
                  temperature: float, weights: torch.Tensor | None = None) -> torch.Tensor:
    """The per-token KL summed over the scored tokens (labels != IGNORE): logits [B, T, V], labels [B, T];
    each token's KL times its weight [B, T] where weights are given."""
    scored = labels != IGNORE  # [B, T]
    kl = token_kl(student_logits[scored], teacher_logits[scored], temperature)  # rows [N, V] -> [N]
    return (kl if weights is None else kl * weights[scored]).sum()


def scored_nll_sum(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """The next-token NLL summed over the scored tokens (labels != IGNORE), in fp32: logits [B, T, V],
    labels [B, T]; each token's NLL times its weight [B, T] where weights are given."""
    nll = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="none")  # [B*T]
    return (nll if weights is None else nll * weights.flatten()).sum()  # ignored labels are 0


def distill_objective(kl, nll, spec: DistillSpec):
    """What the student minimizes: alpha * T^2 * KL + (1 - alpha) * NLL (tensors or numbers)."""
    loss = spec.alpha * spec.temperature**2 * kl
    return loss if spec.alpha == 1 else loss + (1 - spec.alpha) * nll
