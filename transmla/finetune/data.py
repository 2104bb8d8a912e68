"""Training data: documents from a text source, packed into fixed-length sequences.

No attention crosses a document boundary. Every sequence carries a segment id per token (the
document it came from); the model gets

- ``position_ids`` that restart at 0 where a document (or a piece of one) begins, and
- a boolean block-diagonal causal mask [B, 1, T, T]: token i attends to j iff j <= i and both
  belong to the same segment (``segment_mask``),

so a packed sequence computes exactly what each document would compute alone (tested), and a
label is dropped (-100) wherever the next token belongs to another document. With
``packing=False`` each sequence instead holds a piece of one document, padded at the end
(padding: its own segment, no labels).

The data order is a pure function of (seed, step): epoch e visits the sequences in
``randperm(N)`` drawn from a generator seeded with (seed, e), and step s takes the next
``per_step`` sequences of that endless stream, so resuming at step s needs no saved iterator.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..data.texts import load_text, read_jsonl_rows

__all__ = [
    "PackedSequences",
    "StepSampler",
    "document_token_ids",
    "load_documents",
    "pack_documents",
    "segment_mask",
    "segment_positions",
    "split_documents",
]

IGNORE = -100
PAD_SEGMENT = -1
# " = Title = " lines (the built-in wiki text, wikitext); " = = Section = = " lines are not titles.
_HEADING = re.compile(r"^ ?= [^=\n](?:[^\n]*[^=\n])? = ?$", re.MULTILINE)
_BLANK = re.compile(r"\n\s*\n")


# --- documents -----------------------------------------------------------------------------------


def split_documents(text: str, mode: str = "auto") -> list[str]:
    """Cut a text into documents: at " = Title = " heading lines, at blank lines, or not at all.

    ``auto`` uses headings when the text has at least two, else blank-line paragraphs.
    """
    if mode not in ("auto", "headings", "paragraphs", "none"):
        raise ValueError(f"documents must be auto, headings, paragraphs or none, got {mode!r}")
    if mode == "auto":
        mode = "headings" if len(_HEADING.findall(text)) >= 2 else "paragraphs"
    if mode == "none":
        pieces = [text]
    elif mode == "paragraphs":
        pieces = _BLANK.split(text)
    else:
        starts = [m.start() for m in _HEADING.finditer(text)]
        bounds = [0] + starts + [len(text)]
        pieces = [text[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    return [p.strip("\n") for p in pieces if p.strip()]


def load_documents(spec: str, part: str = "calib", text_field: str = "text", mode: str = "auto") -> list[str]:
    """The documents of a text source (transmla.data.texts.load_text spec).

    A local .jsonl file gives one document per row (with ``auto``); every other source is read
    as one text and cut by ``split_documents``.
    """
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == ".jsonl":
        rows = read_jsonl_rows(path, text_field, hint="set data.text_field")
        if mode == "auto":
            return [r for r in rows if r.strip()]
        return split_documents("\n\n".join(rows), mode)
    return split_documents(load_text(spec, part=part, text_field=text_field), mode)


def document_token_ids(tokenizer, documents: list[str]) -> list[torch.Tensor]:
    """Each document's token ids (LongTensor [n_i]), no special tokens added."""
    if not documents:
        return []
    try:
        enc = tokenizer(documents, add_special_tokens=False, verbose=False)
    except TypeError:
        enc = tokenizer(documents, add_special_tokens=False)
    return [torch.tensor(ids, dtype=torch.long) for ids in enc["input_ids"]]


# --- packing -------------------------------------------------------------------------------------


@dataclass
class PackedSequences:
    input_ids: torch.Tensor  # [N, T]
    segment_ids: torch.Tensor  # [N, T] document index per token (PAD_SEGMENT for padding)
    position_ids: torch.Tensor  # [N, T] restart at 0 where a segment begins
    labels: torch.Tensor  # [N, T] next token, IGNORE at document ends and padding
    documents: int  # documents used
    tokens: int  # real (non-padding) tokens
    weights: torch.Tensor | None = None  # [N, T] each label's weight in the loss (data.answer_weight); None: 1

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def batch(self, index: torch.Tensor) -> dict[str, torch.Tensor]:
        """Model inputs for the sequences ``index`` [B]: ids, positions, mask [B, 1, T, T], labels (and
        the labels' weights [B, T] where they are not all 1)."""
        seg = self.segment_ids[index]  # [B, T]
        return {
            "input_ids": self.input_ids[index],
            "position_ids": self.position_ids[index],
            "attention_mask": segment_mask(seg),
            "labels": self.labels[index],
            **({"weights": self.weights[index]} if self.weights is not None else {}),
        }


def segment_positions(segment_ids: torch.Tensor) -> torch.Tensor:
    """[..., T] segment ids -> positions restarting at 0 at each segment start."""
    T = segment_ids.shape[-1]
    ar = torch.arange(T, device=segment_ids.device).expand_as(segment_ids)  # [..., T]
    new = torch.ones_like(segment_ids, dtype=torch.bool)
    new[..., 1:] = segment_ids[..., 1:] != segment_ids[..., :-1]
    start = torch.cummax(torch.where(new, ar, torch.zeros_like(ar)), dim=-1).values  # [..., T]
    return ar - start


def segment_labels(input_ids: torch.Tensor, segment_ids: torch.Tensor) -> torch.Tensor:
    """Next-token labels [..., T]; IGNORE where the next token is in another segment, or padding."""
    labels = torch.full_like(input_ids, IGNORE)
    same = (segment_ids[..., 1:] == segment_ids[..., :-1]) & (segment_ids[..., 1:] != PAD_SEGMENT)
    labels[..., :-1] = torch.where(same, input_ids[..., 1:], torch.full_like(input_ids[..., 1:], IGNORE))
    return labels


def segment_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """Block-diagonal causal mask [B, 1, T, T] (True = attend) from segment ids [B, T]."""
    T = segment_ids.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=segment_ids.device).tril()  # [T, T]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]  # [B, T, T]
    return (same & causal)[:, None]  # [B, 1, T, T]


def pack_documents(
    docs: list[torch.Tensor],
    seq_len: int,
    packing: bool = True,
    pad_id: int = 0,
    min_tokens: int = 2,
) -> PackedSequences:
    """Fixed-length sequences [N, seq_len] from token-id documents (see the module docstring).

    packing: documents end to end, the stream cut every seq_len tokens (the last partial
    sequence dropped); a document may continue into the next sequence, where its piece is a
    new segment. Otherwise: each document cut into seq_len pieces, the last one padded.
    """
    docs = [d for d in docs if d.numel() >= min_tokens]
    if not docs:
        raise ValueError(f"no document has at least {min_tokens} tokens")
    if packing:
        ids = torch.cat(docs)  # [S]
        seg = torch.cat([torch.full((d.numel(),), i, dtype=torch.long) for i, d in enumerate(docs)])  # [S]
        n = ids.numel() // seq_len
        if n == 0:
            raise ValueError(f"the training text has {ids.numel()} tokens, fewer than one sequence of {seq_len}")
        ids = ids[: n * seq_len].view(n, seq_len)  # [N, T]
        seg = seg[: n * seq_len].view(n, seq_len)  # [N, T]
    else:
        rows_ids, rows_seg = [], []
        for i, d in enumerate(docs):
            for piece in d.split(seq_len):
                if piece.numel() < min_tokens:
                    continue
                pad = seq_len - piece.numel()
                rows_ids.append(torch.cat([piece, torch.full((pad,), pad_id, dtype=torch.long)]))
                rows_seg.append(torch.cat([torch.full((piece.numel(),), i), torch.full((pad,), PAD_SEGMENT)]))
        ids, seg = torch.stack(rows_ids), torch.stack(rows_seg).long()  # [N, T]
    positions = segment_positions(seg)
    positions = torch.where(seg == PAD_SEGMENT, torch.zeros_like(positions), positions)
    return PackedSequences(
        input_ids=ids.contiguous(),
        segment_ids=seg.contiguous(),
        position_ids=positions.contiguous(),
        labels=segment_labels(ids, seg),
        documents=len(docs),
        tokens=int((seg != PAD_SEGMENT).sum()),
    )


# --- order ---------------------------------------------------------------------------------------


class StepSampler:
    """Which sequences step s uses: a pure function of (seed, step) over an endless reshuffled stream."""

    def __init__(self, n: int, per_step: int, seed: int = 0) -> None:
        if n < 1:
            raise ValueError("no training sequences")
        self.n, self.per_step, self.seed = n, per_step, seed
        self._orders: dict[int, torch.Tensor] = {}

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._orders = {epoch: torch.randperm(self.n, generator=g)}  # keep one epoch in memory
        return self._orders[epoch]

    def indices(self, step: int) -> torch.Tensor:
        """Sequence indices [per_step] of optimizer step ``step`` (0-based)."""
        out = []
        for k in range(step * self.per_step, (step + 1) * self.per_step):
            out.append(int(self._order(k // self.n)[k % self.n]))
        return torch.tensor(out, dtype=torch.long)

    def epoch(self, step: int) -> float:
        return step * self.per_step / self.n
