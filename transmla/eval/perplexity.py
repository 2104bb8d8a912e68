"""Token-level perplexity of a causal LM over a token stream.

Two protocols, one code path (a list of windows, each with the first position it scores):

- ``non-overlapping`` (default, the one behind ANCHORS.md): windows
  ``ids[i*L:(i+1)*L]`` for the first ``max_windows`` full windows; every token but the first
  of each window is scored. 32 windows of 512 tokens score 32 * 511 = 16,352 tokens.
- ``sliding`` (``stride`` given): the Hugging Face perplexity guide's strided evaluation over
  the same span of tokens: a context window of ``L`` tokens moves by ``stride``; each step
  scores only the tokens not scored before (the guide's ``-100`` mask). With
  ``stride == L`` the windows, and so the result, are exactly the non-overlapping ones.

``first_scored`` (non-overlapping only) scores each window from that position on: llama.cpp's
llama-perplexity scores the second half of each window, ``first_scored = L // 2 + 1``.

perplexity = exp(total NLL / scored tokens); log-softmax in float32, sums in float64.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transmla.checkpoint.finite import require_finite_number
from transmla.data.calib import tokenize_text
from transmla.progress import progress_bar

__all__ = ["PerplexityResult", "perplexity", "tokenize_text", "plan_windows"]


@dataclass
class PerplexityResult:
    """Outcome of one perplexity run; ``nll`` is the mean NLL per scored token (nats)."""

    perplexity: float
    nll: float
    tokens: int
    windows: int
    seq_len: int
    stride: int | None
    protocol: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class _Window:
    begin: int  # first token of the window in ids
    end: int  # one past the last token
    first_scored: int  # first window position whose token is scored (>= 1)


def plan_windows(
    n_tokens: int, seq_len: int, max_windows: int | None = None, stride: int | None = None,
    first_scored: int = 1,
) -> list[_Window]:
    """The windows a run evaluates (see the module docstring for both protocols)."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    n_full = n_tokens // seq_len
    if n_full == 0:
        raise ValueError(
            f"text too short: {n_tokens} tokens, one window needs seq_len={seq_len}"
        )
    if max_windows is not None:
        if max_windows < 1:
            raise ValueError(f"max_windows must be positive, got {max_windows}")
        n_full = min(n_full, max_windows)
    if not 1 <= first_scored < seq_len or (first_scored != 1 and stride is not None):
        raise ValueError(f"first_scored must be in [1, seq_len) and only without a stride, got {first_scored}")
    if stride is None:
        return [_Window(i * seq_len, (i + 1) * seq_len, first_scored) for i in range(n_full)]
    if not 1 <= stride <= seq_len:
        raise ValueError(f"stride must be in [1, seq_len={seq_len}], got {stride}")
    span = n_full * seq_len  # the same tokens the non-overlapping protocol covers
    windows: list[_Window] = []
    prev_end = 0
    for begin in range(0, span, stride):
        end = min(begin + seq_len, span)
        trg_len = end - prev_end  # tokens not scored by an earlier step
        windows.append(_Window(begin, end, max(1, (end - begin) - trg_len)))
        prev_end = end
        if end == span:
            break
    return windows


def _batches(windows: list[_Window], batch_size: int) -> list[list[_Window]]:
    """Consecutive windows of equal length, at most batch_size per batch."""
    out: list[list[_Window]] = []
    for w in windows:
        last = out[-1] if out else None
        if (
            last is not None
            and len(last) < batch_size
            and last[0].end - last[0].begin == w.end - w.begin
        ):
            last.append(w)
        else:
            out.append([w])
    return out


def _model_device(model: torch.nn.Module) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def perplexity(
    model: torch.nn.Module,
    ids: torch.Tensor,
    seq_len: int = 512,
    max_windows: int | None = None,
    stride: int | None = None,
    batch_size: int = 4,
    progress: bool = True,
    first_scored: int = 1,
    inference_mode: bool = True,
) -> PerplexityResult:
    """Perplexity of ``model`` (any HF causal LM) on the 1-D token stream ``ids``.
    ``inference_mode=False`` runs under no_grad instead, for a model whose tensors are written
    in place afterwards (an FSDP-sharded one in training re-gathers into the same buffers)."""
    ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)  # [N]
    windows = plan_windows(ids.numel(), seq_len, max_windows, stride, first_scored)
    device = _model_device(model)
    was_training = model.training
    model.eval()
    total_nll = 0.0  # python float == float64
    scored = 0
    try:
        with torch.inference_mode() if inference_mode else torch.no_grad():
            batches = _batches(windows, max(1, batch_size))
            for batch in progress_bar(batches, "perplexity", enabled=progress, total=len(windows), size=len):
                x = torch.stack([ids[w.begin : w.end] for w in batch]).to(device)  # [B, T]
                logits = model(input_ids=x, use_cache=False).logits  # [B, T, V]
                # one window's log-probabilities at a time: a [T-1, V] temporary instead of [B, T-1, V] (the
                # vocabulary makes it the eval's largest tensor: 0.3 GB per window of 512 at a 150K vocabulary)
                tok_nll = torch.stack([-F.log_softmax(logits[b, :-1].float(), dim=-1).gather(-1, x[b, 1:, None]).squeeze(-1)
                                       for b in range(x.shape[0])])  # [B, T-1]
                del logits
                pos = torch.arange(1, x.shape[1], device=device)  # [T-1] target positions
                first = torch.tensor([w.first_scored for w in batch], device=device)  # [B]
                mask = pos[None, :] >= first[:, None]  # [B, T-1]
                total_nll += tok_nll[mask].double().sum().item()
                scored += int(mask.sum().item())
    finally:
        model.train(was_training)
    nll = require_finite_number(total_nll / scored, "the mean negative log-likelihood")
    return PerplexityResult(
        perplexity=math.exp(nll),
        nll=nll,
        tokens=scored,
        windows=len(windows),
        seq_len=seq_len,
        stride=stride,
        protocol="non-overlapping" if stride is None else "sliding",
    )
