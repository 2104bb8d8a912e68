"""Passkey retrieval by likelihood: the passkey prompts of eval/passkey.py, each followed by its key,
scored in one forward pass under teacher forcing.

Where `transmla eval --task passkey` asks whether the greedy answer holds the key (a yes or no per
prompt, through the model's cache), the probe measures how far a model is from answering: the mean
negative log-likelihood of the key's tokens after "The pass key is", and whether every key token is
the model's top choice (teacher-forced exact match, which is the greedy answer starting with the key
in all but rare ties). It needs no generation, so it is cheap enough to run after every stage of a
conversion (eval/stages.py) and sensitive to losses that do not yet flip an answer. One forward over
the whole prompt: the expanded attention path, not the latent cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .passkey import PasskeySettings, build_prompt, filler_paragraphs, trials

ANSWER_PREFIX = " "  # the question ends "The pass key is"; the answer is " 41729"


def key_tokens(tokenizer, key: str) -> list[int]:
    return list(tokenizer(ANSWER_PREFIX + key, add_special_tokens=False)["input_ids"])


@torch.no_grad()
def key_probe(net, tokenizer, settings: PasskeySettings, lengths: Sequence[int]) -> dict[str, Any]:
    """Per length x depth cell: mean key NLL (nats per key token) and teacher-forced exact matches;
    the same prompts (keys, filler, depths) as the passkey task with the same settings."""
    paragraphs = filler_paragraphs(settings.filler)
    cells: dict[tuple[int, float], dict[str, Any]] = {}
    for t in trials(lengths, settings.depth_list, settings.keys, settings.seed, len(paragraphs)):
        prompt = build_prompt(tokenizer, paragraphs, t.length, t.depth, t.key, t.start_paragraph)
        answer = torch.tensor(key_tokens(tokenizer, t.key), dtype=torch.long)
        ids = torch.cat((prompt.ids, answer))[None].to(net.device)  # [1, L + k]
        logits = net(input_ids=ids, logits_to_keep=answer.numel() + 1).logits[0, :-1].float()  # [k, V]
        target = answer.to(logits.device)
        nll = F.cross_entropy(logits, target).item()
        exact = bool((logits.argmax(-1) == target).all())
        cell = cells.setdefault((t.length, t.depth), {"length": t.length, "depth": t.depth, "nll": [], "exact": 0})
        cell["nll"].append(nll)
        cell["exact"] += int(exact)
    rows = [c | {"keys": len(c["nll"]), "nll": sum(c["nll"]) / len(c["nll"])} for c in cells.values()]
    keys = sum(r["keys"] for r in rows)
    return {"cells": rows, "exact": sum(r["exact"] for r in rows), "keys": keys,
            "nll": sum(r["nll"] * r["keys"] for r in rows) / keys if keys else float("nan")}


__all__ = ["key_probe", "key_tokens"]
