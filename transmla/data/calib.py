"""Calibration batches: random non-overlapping token chunks of a text's calibration part."""

from __future__ import annotations

import torch

from transmla.data.texts import load_text

__all__ = ["tokenize_text", "calibration_chunks"]


def tokenize_text(tokenizer, text: str) -> torch.Tensor:
    """Token ids of ``text`` as a LongTensor [N], no special tokens (no BOS/EOS added).

    The "sequence longer than the model maximum" warning is silenced: long streams are
    expected here and are cut into windows afterwards.
    """
    try:
        enc = tokenizer(text, add_special_tokens=False, verbose=False)
    except TypeError:  # a tokenizer whose __call__ takes no verbose flag
        enc = tokenizer(text, add_special_tokens=False)
    ids = enc["input_ids"] if isinstance(enc, dict) or hasattr(enc, "keys") else enc
    return torch.tensor(ids, dtype=torch.long)  # [N]


def calibration_chunks(
    tokenizer, spec: str, n_samples: int, seq_len: int, seed: int = 0
) -> torch.Tensor:
    """``n_samples`` distinct ``seq_len``-token chunks of the calibration part of ``spec``.

    The text is cut into non-overlapping chunks ``ids[i*seq_len:(i+1)*seq_len]``; a
    ``torch.Generator`` seeded with ``seed`` picks ``n_samples`` of them without replacement
    and they are returned in text order. Returns a LongTensor [n_samples, seq_len].
    """
    if n_samples < 1 or seq_len < 1:
        raise ValueError(f"n_samples and seq_len must be positive, got {n_samples}, {seq_len}")
    ids = tokenize_text(tokenizer, load_text(spec, part="calib"))  # [N]
    n_chunks = ids.numel() // seq_len
    if n_chunks < n_samples:
        raise ValueError(
            f"calibration text {spec!r} has {n_chunks} chunks of {seq_len} tokens "
            f"({ids.numel()} tokens), {n_samples} were asked for"
        )
    chunks = ids[: n_chunks * seq_len].view(n_chunks, seq_len)  # [n_chunks, seq_len]
    g = torch.Generator().manual_seed(seed)
    pick = torch.randperm(n_chunks, generator=g)[:n_samples].sort().values  # [n_samples]
    return chunks[pick].clone()  # [n_samples, seq_len]
