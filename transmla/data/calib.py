"""Calibration batches: random non-overlapping token chunks of a text's calibration part, or of
several texts mixed by weight (``wiki=3,lee=1``)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from transmla.data.texts import load_text

__all__ = ["tokenize_text", "calibration_chunks", "calibration_mix", "picked_chunks", "split_samples", "longest_repeatable_span", "with_repeated_span"]


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


def calibration_mix(spec: str) -> list[tuple[str, float]]:
    """``spec`` as (text, weight) pairs: one text (``wiki``, ``lee``, a path, a dataset name), or
    a comma-separated mix ``wiki=3,lee=1,PATH`` whose weights (1 when left out) are relative."""
    if "," not in spec and "=" not in spec or Path(spec).exists():
        return [(spec, 1.0)]
    mix: list[tuple[str, float]] = []
    for part in spec.split(","):
        name, eq, weight = part.strip().rpartition("=") if "=" in part else ("", "", "")
        name, weight = (name.strip(), weight.strip()) if eq else (part.strip(), "1")
        try:
            w = float(weight)
        except ValueError:
            w = math.nan
        if not name or not (math.isfinite(w) and w > 0):
            raise ValueError(f"calibration mix {spec!r}: each part is TEXT or TEXT=WEIGHT with a positive weight, got {part!r}")
        if any(name == seen for seen, _ in mix):
            raise ValueError(f"calibration mix {spec!r} names {name!r} twice")
        mix.append((name, w))
    return mix


def split_samples(n_samples: int, weights: list[float]) -> list[int]:
    """``n_samples`` shared out by ``weights``: one each, the rest in proportion (largest remainder,
    ties to the earlier text)."""
    if n_samples < len(weights):
        raise ValueError(f"{n_samples} calibration sequences cannot be shared by {len(weights)} texts")
    rest, total = n_samples - len(weights), sum(weights)
    exact = [rest * w / total for w in weights]
    counts = [1 + math.floor(x) for x in exact]
    for i in sorted(range(len(weights)), key=lambda i: (-(exact[i] - math.floor(exact[i])), i))[: n_samples - sum(counts)]:
        counts[i] += 1
    return counts


def calibration_chunks(
    tokenizer, spec: str, n_samples: int, seq_len: int, seed: int = 0
) -> torch.Tensor:
    """``n_samples`` distinct ``seq_len``-token chunks of the calibration part of ``spec``.

    The text is cut into non-overlapping chunks ``ids[i*seq_len:(i+1)*seq_len]``; a
    ``torch.Generator`` seeded with ``seed`` picks ``n_samples`` of them without replacement
    and they are returned in text order. A mix (``wiki=3,lee=1``) takes each text's share of the
    samples (split_samples) the same way, the texts in the order given. Returns a LongTensor
    [n_samples, seq_len].
    """
    if n_samples < 1 or seq_len < 1:
        raise ValueError(f"n_samples and seq_len must be positive, got {n_samples}, {seq_len}")
    mix = calibration_mix(spec)
    if len(mix) > 1:
        counts = split_samples(n_samples, [w for _, w in mix])
        return torch.cat([calibration_chunks(tokenizer, text, n, seq_len, seed) for (text, _), n in zip(mix, counts)])
    ids = tokenize_text(tokenizer, load_text(spec, part="calib"))  # [N]
    n_chunks = ids.numel() // seq_len
    if n_chunks < n_samples:
        raise ValueError(
            f"calibration text {spec!r} has {n_chunks} chunks of {seq_len} tokens "
            f"({ids.numel()} tokens), {n_samples} were asked for"
        )
    chunks = ids[: n_chunks * seq_len].view(n_chunks, seq_len)  # [n_chunks, seq_len]
    return chunks[picked_chunks(n_chunks, n_samples, seed)].clone()  # [n_samples, seq_len]


def picked_chunks(n_chunks: int, n_samples: int, seed: int) -> torch.Tensor:
    """Which of a text's ``n_chunks`` chunks calibration_chunks takes: [n_samples] indices in text order. The
    first ``n_samples`` of one seeded permutation, so a larger count takes a superset of a smaller one's."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(n_chunks, generator=g)[:n_samples].sort().values  # [n_samples]


SHORTEST_SPAN = 32  # tokens: with_repeated_span's shortest span by default


def longest_repeatable_span(seq_len: int, longest: int = 128) -> int:
    """The longest span with_repeated_span can copy in a sequence of seq_len tokens: a span and its
    copy after token 0 (the attention sink), so at most (seq_len - 1) // 2; where that is below its
    `shortest`, with_repeated_span writes nothing."""
    return min(longest, (seq_len - 1) // 2)


def with_repeated_span(ids: torch.Tensor, seed: int, shortest: int = SHORTEST_SPAN, longest: int = 128,
                       spans: int = 1) -> torch.Tensor:
    """ids [N, T] with, in each sequence, `spans` spans of `shortest`..`longest` tokens (at most
    (T - 1) // 2) each copied over a later place of the same sequence (one after another, seeds seed,
    seed + 1, ...: a later copy may overwrite an earlier one), token 0 (the attention sink) kept;
    unchanged when T leaves no room for two spans of `shortest`. Where a copy runs, the source attends
    back to its first span, up to T tokens away, as when it repeats a key stated long before: fit
    targets that hold such reads (issue 34). Seeded, reproducible."""
    N, T = ids.shape
    longest = longest_repeatable_span(T, longest)
    if longest < shortest:
        return ids
    out = ids.clone()
    for i in range(spans):
        gen = torch.Generator().manual_seed(seed + i)
        for row in out:
            n = int(torch.randint(shortest, longest + 1, (1,), generator=gen))
            first = int(torch.randint(1, T - 2 * n + 1, (1,), generator=gen))  # the span [first, first + n)
            second = int(torch.randint(first + n, T - n + 1, (1,), generator=gen))  # its copy, after it
            row[second : second + n] = row[first : first + n].clone()
    return out
