"""Multiple-choice tasks built from installed text, scored by log-likelihood as lm-eval scores its
multiple-choice tasks: each item is a context and a few candidate continuations, one of them true;
the model "answers" with the candidate of highest log-likelihood given the context (acc), or of
highest log-likelihood per character (acc_norm, lm-eval's length normalisation).

- cloze: a passage of held-out prose (the evaluation parts of the built-in texts, never calibrated
  on), cut at a sentence end; the true next sentence against sentences of other passages of about
  the same length. It measures what perplexity measures, as a task score: local coherence and
  knowledge over a few hundred tokens.
- recall: facts stated once at the start ("Mr. Smith lives in Lisbon."), then real filler prose of
  a given length, then a question about one fact, the candidates being every city named at the
  start. It needs something said far back (associative recall over the whole context), where
  perplexity over short windows sees nothing.

Items are seeded; the same settings give the same items for every model (a converted model and its
source are scored on identical prompts). The context runs once per item, its cache shared by the
candidates.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from ..schema import option

TASKS = ("cloze", "recall")
_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
SURNAMES = ("Smith", "Okafor", "Larsen", "Moreau", "Tanaka", "Novak", "Silva", "Kowalski", "Haddad", "Fischer",
            "Rossi", "Nguyen", "Murphy", "Ivanova", "Costa", "Berg")
CITIES = ("Lisbon", "Nairobi", "Oslo", "Lyon", "Osaka", "Prague", "Lima", "Warsaw", "Beirut", "Munich",
          "Naples", "Hanoi", "Dublin", "Kazan", "Porto", "Bergen")


@dataclass
class ChoiceSettings:
    """The multiple-choice protocol (flags of `transmla eval --task cloze|recall`)."""

    # items, choices, context_tokens and task_seed are also the code task's flags (eval/code_task.py).
    items: int = option(100, "cloze/recall/code: items (questions, functions) scored (default: 100; code: 50).")
    choices: int = option(4, "cloze/recall/code: candidates per item, one of them true (code: 1 skips the "
                          "choice scoring).")
    context_tokens: int = option(1024, "cloze: tokens of passage before the sentence to choose (at most); "
                                 "recall: tokens of filler between the facts and the question; code: tokens of "
                                 "module text before the function, at most (default: 1024; code: 512).")
    task_seed: int = option(0, "cloze/recall/code: seed of the items.")
    texts: str = option("wiki,lee", "cloze/recall: built-in texts (their evaluation parts) or .txt files, comma-separated.")

    def __post_init__(self) -> None:
        if self.items < 1:
            raise ValueError(f"items must be at least 1, got {self.items}")
        if not 2 <= self.choices <= len(CITIES):
            raise ValueError(f"choices must be between 2 and {len(CITIES)}, got {self.choices}")
        if self.context_tokens < 16:
            raise ValueError(f"context_tokens must be at least 16, got {self.context_tokens}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ChoiceItem:
    context: list[int]  # token ids before the candidates
    candidates: list[list[int]]  # token ids of each candidate continuation
    answer: int  # index of the true candidate
    chars: list[int] = field(default_factory=list)  # characters of each candidate (acc_norm)


def _paragraphs(texts: str) -> list[str]:
    from .passkey import filler_paragraphs  # the same reader as the passkey filler

    return filler_paragraphs(texts)


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def cloze_items(tokenizer, settings: ChoiceSettings) -> list[ChoiceItem]:
    """Passages cut before a sentence; the true sentence against sentences of other passages whose
    length is closest to it (so length alone does not give the answer away)."""
    rng = random.Random(settings.task_seed)
    paragraphs = [p for p in _paragraphs(settings.texts) if len(_SENTENCE.split(p)) >= 3]
    if len(paragraphs) < settings.choices + 1:
        raise ValueError(f"the texts {settings.texts!r} hold too few passages of three sentences or more")
    pool = [s for p in paragraphs for s in _SENTENCE.split(p)[1:] if 20 <= len(s) <= 300]
    items = []
    for _ in range(settings.items):
        i = rng.randrange(len(paragraphs))
        sentences = _SENTENCE.split(paragraphs[i])
        cut = rng.randrange(2, len(sentences))
        context = _encode(tokenizer, " ".join(sentences[:cut]))[-settings.context_tokens :]
        truth = " " + sentences[cut]
        own = set(sentences)
        others = [s for s in rng.sample(pool, min(len(pool), 40 * settings.choices)) if s not in own]
        others.sort(key=lambda s: abs(len(s) - len(truth)))
        texts = [truth] + [" " + s for s in others[: settings.choices - 1]]
        order = list(range(len(texts)))
        rng.shuffle(order)
        shuffled = [texts[k] for k in order]
        items.append(ChoiceItem(context, [_encode(tokenizer, t) for t in shuffled], order.index(0),
                                [len(t) for t in shuffled]))
    return items


def recall_items(tokenizer, settings: ChoiceSettings) -> list[ChoiceItem]:
    """`choices` people, each living in a different city, stated once at the start; filler prose of
    `context_tokens` tokens; then the question about one of them, every stated city a candidate."""
    rng = random.Random(settings.task_seed)
    paragraphs = _paragraphs(settings.texts)
    items = []
    for _ in range(settings.items):
        people = rng.sample(SURNAMES, settings.choices)
        cities = rng.sample(CITIES, settings.choices)
        facts = " ".join(f"Mr. {p} lives in {c}." for p, c in zip(people, cities))
        head = _encode(tokenizer, f"Remember where each person lives. {facts}\n")
        start = rng.randrange(len(paragraphs))
        filler: list[int] = []
        j = start
        while len(filler) < settings.context_tokens:
            filler += _encode(tokenizer, paragraphs[j % len(paragraphs)] + "\n")
            j += 1
        asked = rng.randrange(settings.choices)
        question = _encode(tokenizer, f"\nWhere does Mr. {people[asked]} live? Mr. {people[asked]} lives in")
        context = head + filler[: settings.context_tokens] + question
        items.append(ChoiceItem(context, [_encode(tokenizer, " " + c) for c in cities], asked,
                                [len(c) + 1 for c in cities]))
    return items


@torch.no_grad()
def candidate_loglik(net, context: Sequence[int], candidates: Sequence[Sequence[int]]) -> list[float]:
    """Sum of log p(candidate tokens | context) for each candidate. The context runs once, through
    the model's own cache (the latent cache for a conversion); the cache, repeated once per
    candidate, then serves every candidate's tokens in one batched step, right-padded (padding comes
    after every scored position, so causal attention never sees it). The sums are those of one full
    pass per candidate (a token attends to earlier tokens only), at a quarter of the cost for four
    candidates after a long context."""
    from transformers import DynamicCache

    from ..mla.latent_cache import cache_kwargs
    from ..mla.model import is_mla_config, new_latent_cache

    if not context or not candidates or not all(candidates):
        raise ValueError("candidate_loglik needs a context and non-empty candidates")
    device = next(net.parameters()).device
    width = max(len(c) for c in candidates) - 1  # tokens fed after the context: all but each candidate's last
    cache = (new_latent_cache(net, len(context) + width) if is_mla_config(net.config)
             else DynamicCache(config=net.config))
    ctx = torch.tensor([list(context)], device=device)  # [1, T]
    out = net(input_ids=ctx, **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
    first = F.log_softmax(out.logits[0, -1].float(), dim=-1)  # [V]: predicts every candidate's first token
    scores = [first[cand[0]].item() for cand in candidates]
    if width == 0:
        return scores
    cache.batch_repeat_interleave(len(candidates))
    ids = torch.zeros(len(candidates), width, dtype=torch.long)
    for b, cand in enumerate(candidates):
        ids[b, : len(cand) - 1] = torch.tensor(list(cand[:-1]))
    position_ids = torch.arange(len(context), len(context) + width, device=device)[None].expand(len(candidates), -1)
    logits = net(input_ids=ids.to(device), position_ids=position_ids, **cache_kwargs(cache), use_cache=True).logits
    logp = F.log_softmax(logits.float(), dim=-1)  # [C, width, V]: position t predicts candidate token t + 1
    for b, cand in enumerate(candidates):
        for t in range(1, len(cand)):
            scores[b] += logp[b, t - 1, cand[t]].item()
    return scores


def choice_hits(ll: Sequence[float], answer: int, chars: Sequence[int]) -> tuple[bool, bool]:
    """Whether the true candidate has the highest log-likelihood (acc), and per character (acc_norm)."""
    norm = [v / n for v, n in zip(ll, chars)]
    best = lambda values: max(range(len(values)), key=values.__getitem__)  # noqa: E731
    return best(ll) == answer, best(norm) == answer


def score_items(net, items: Sequence[ChoiceItem], progress: bool = False, label: str = "choices") -> dict[str, Any]:
    """acc (highest log-likelihood is the true candidate), acc_norm (per character) and nll (the mean
    -log of the true candidate's share of the candidates' likelihoods: a graded acc, lower is better,
    log(choices) at chance), over the items."""
    from ..progress import progress_bar

    acc = acc_norm = 0
    nll = 0.0
    for item in progress_bar(items, label, enabled=progress):
        ll = candidate_loglik(net, item.context, item.candidates)
        hit, hit_norm = choice_hits(ll, item.answer, item.chars)
        acc += hit
        acc_norm += hit_norm
        nll += torch.logsumexp(torch.tensor(ll, dtype=torch.float64), 0).item() - ll[item.answer]
    n = len(items)
    return {"items": n, "acc": acc / n, "acc_norm": acc_norm / n, "nll": nll / n, "chance": 1 / len(items[0].candidates)}


def build_items(task: str, tokenizer, settings: ChoiceSettings) -> list[ChoiceItem]:
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    return (cloze_items if task == "cloze" else recall_items)(tokenizer, settings)


def evaluate_choices(spec: str, task: str, settings: ChoiceSettings, dtype: torch.dtype = torch.float32,
                     device: str = "cpu", role: str = "model", progress: bool = True) -> dict[str, Any]:
    """Load ``spec`` and score the task's items on it."""
    import gc
    import time

    from ..checkpoint.resolve import load_model

    net, tokenizer = load_model(str(spec), dtype=dtype, device=device)
    try:
        start = time.perf_counter()
        result = score_items(net, build_items(task, tokenizer, settings), progress=progress, label=f"{task} {role}")
        return {"model": str(spec), "role": role, "task": task, **result,
                "seconds": round(time.perf_counter() - start, 1)}
    finally:
        del net
        gc.collect()


__all__ = ["CITIES", "ChoiceItem", "ChoiceSettings", "SURNAMES", "TASKS", "build_items", "candidate_loglik",
           "choice_hits", "cloze_items", "evaluate_choices", "recall_items", "score_items"]
