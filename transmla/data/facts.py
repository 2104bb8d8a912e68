"""Stated facts written over training text: associative recall to heal on (issue 34).

A group is a few people, each given a value of one attribute in one sentence ("Anna's favourite
colour is green. Boris's favourite colour is red. ..."), written over the first half of a token
sequence; later, in its second half, some of them are asked about and answered ("What is Boris's
favourite colour? Boris's favourite colour is red."). Answering needs the value stated hundreds of
tokens back for that one person among several stated the same way: the read a model converted to
MLA loses first. The teacher of a distillation reads these sequences as it reads any text, so its
signal on the answers is how the source itself recalls.

Names, attributes and phrasing are none of the recall task's (transmla.eval.choice_tasks: "Mr.
<surname> lives in <city>"), so healing on them cannot learn that task's items.
"""

from __future__ import annotations

import random

import torch

from .calib import tokenize_text

__all__ = ["ATTRIBUTES", "NAMES", "answer_tokens", "with_stated_facts"]

NAMES = ("Anna", "Boris", "Chloe", "Daniel", "Elena", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Keiko", "Liam",
         "Maya", "Nikolai", "Olga", "Pedro", "Rosa", "Samir", "Tessa", "Umar", "Vera", "Wendy", "Yusuf", "Zoe")
_COLOURS = ("red", "blue", "green", "yellow", "purple", "orange", "white", "black", "grey", "brown")
_PETS = ("cat", "dog", "parrot", "rabbit", "turtle", "goat", "horse", "hamster", "ferret", "goldfish")
_JOBS = ("baker", "nurse", "pilot", "teacher", "farmer", "lawyer", "plumber", "chemist", "sailor", "painter")
_INSTRUMENTS = ("piano", "violin", "flute", "drums", "guitar", "cello", "trumpet", "harp", "banjo", "organ")
_ROOMS = tuple(str(n) for n in range(104, 1000, 37))
# (statement, question, the answer's lead-in, values); {n} a name, {v} a value.
ATTRIBUTES = (
    ("{n}'s favourite colour is {v}.", "What is {n}'s favourite colour?", "{n}'s favourite colour is", _COLOURS),
    ("{n} keeps a {v} as a pet.", "Which pet does {n} keep?", "{n} keeps a", _PETS),
    ("{n} works as a {v}.", "What is {n}'s job?", "{n} works as a", _JOBS),
    ("{n} plays the {v}.", "Which instrument does {n} play?", "{n} plays the", _INSTRUMENTS),
    ("{n} sleeps in room {v}.", "Which room does {n} sleep in?", "{n} sleeps in room", _ROOMS),
)


def _group(tokenizer, rng: random.Random, people: int, asked: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One group's statement block and its questions with their answers, as token ids [n] each, and
    which of the questions block's tokens are the answers' values [n] bool (answer_tokens; each value with
    the space before it, which real tokenizers hold in the value's first token)."""
    statement, question, lead, values = ATTRIBUTES[rng.randrange(len(ATTRIBUTES))]
    names = rng.sample(NAMES, people)
    picked = rng.sample(values, people)
    stated = " ".join(statement.format(n=n, v=v) for n, v in zip(names, picked))
    parts = [(f"{question.format(n=names[i])} {lead.format(n=names[i])}", f" {picked[i]}", ".")
             for i in rng.sample(range(people), asked)]
    asks = " ".join("".join(p) for p in parts)
    text = f"\n{asks}\n"
    ids = tokenize_text(tokenizer, text)
    spans, at = [], 1  # each value's [start, end) in characters of text
    for ask, value, stop in parts:
        spans.append((at + len(ask), at + len(ask) + len(value)))
        at += len(ask) + len(value) + len(stop) + 1
    return tokenize_text(tokenizer, f"\n{stated}\n"), ids, answer_tokens(tokenizer, text, ids, spans)


def answer_tokens(tokenizer, text: str, ids: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """[len(ids)] bool: the tokens of text (tokenized as ids) that spell each character span [start, end),
    found as the tokens of text[:end] beyond those of text[:start]. A span whose prefixes do not tokenize
    as prefixes of ids (a token across its edge) is not marked."""
    mask = torch.zeros(len(ids), dtype=torch.bool)
    for start, end in spans:
        before, through = tokenize_text(tokenizer, text[:start]), tokenize_text(tokenizer, text[:end])
        if len(through) > len(before) and torch.equal(ids[: len(through)], through) \
                and torch.equal(through[: len(before)], before):
            mask[len(before) : len(through)] = True
    return mask


def _starts(rng: random.Random, lengths: list[int], lo: int, hi: int) -> list[int] | None:
    """Start positions of blocks of these lengths laid in order, apart, at random inside [lo, hi)."""
    slack = hi - lo - sum(lengths)
    if slack < 0:
        return None
    cuts = sorted(rng.randint(0, slack) for _ in lengths)  # the gap before each block: a random composition
    starts, at = [], lo
    for cut, prev, n in zip(cuts, [0] + cuts[:-1], lengths):
        at += cut - prev
        starts.append(at)
        at += n
    return starts


def with_stated_facts(ids: torch.Tensor, tokenizer, seed: int, groups: int = 2, people: int = 4,
                      asked: int = 2, answers: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """ids [N, T] with, in each sequence, `groups` groups of `people` stated facts written over its
    first half (token 0, the attention sink, kept) and `asked` of each group's people asked and
    answered in its second half, the groups' questions in the order of their statements. A sequence
    too short for its blocks stays as it is. Seeded by (seed, row): reproducible. With `answers`, also
    [N, T] bool: where the answers' values were written (the tokens that recall what was stated)."""
    N, T = ids.shape
    out = ids.clone()
    mask = torch.zeros(N, T, dtype=torch.bool)
    for r in range(N):
        rng = random.Random(seed * 1_000_003 + r)
        blocks = [_group(tokenizer, rng, people, asked) for _ in range(groups)]
        stated = _starts(rng, [len(s) for s, _, _ in blocks], 1, T // 2)
        asks = _starts(rng, [len(q) for _, q, _ in blocks], T // 2, T)
        if stated is None or asks is None:
            continue
        for (s, q, value), a, b in zip(blocks, stated, asks):
            out[r, a : a + len(s)] = s
            out[r, b : b + len(q)] = q
            mask[r, b : b + len(q)] = value
    return (out, mask) if answers else out
