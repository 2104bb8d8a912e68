"""data.facts.with_stated_facts: stated facts written over training text, asked later (issue 34)."""

from __future__ import annotations

import re

import pytest
import torch

from transmla.data.facts import ATTRIBUTES, NAMES, answer_tokens, with_stated_facts
from transmla.eval.choice_tasks import CITIES, SURNAMES


class CharTokenizer:
    """One token per character (ids = code points): decoding is exact and offsets are visible."""

    def __call__(self, text, add_special_tokens=False):
        if isinstance(text, list):
            return {"input_ids": [[ord(c) for c in t] for t in text]}
        return {"input_ids": [ord(c) for c in text]}


def _text(row: torch.Tensor) -> str:
    return "".join(chr(int(i)) for i in row)


def test_each_answer_is_the_value_stated_earlier_for_that_person():
    """Every question in a row's second half is answered with the value its group stated for that
    person in the first half; the rest of the row (token 0 included) is untouched."""
    tok = CharTokenizer()
    ids = torch.full((6, 2048), ord("~"))
    out = with_stated_facts(ids, tok, seed=7, groups=2)
    assert torch.equal(out, with_stated_facts(ids, tok, seed=7, groups=2))
    assert not torch.equal(out, with_stated_facts(ids, tok, seed=8, groups=2))
    for row in out:
        text = _text(row)
        assert text[0] == "~"
        first, second = text[:1024], text[1024:]
        answered = 0
        for statement, question, lead, _ in ATTRIBUTES:
            pattern = re.escape(question).replace(re.escape("{n}"), r"(\w+)") + " " + \
                re.escape(lead).replace(re.escape("{n}"), r"(\w+)") + r" (\w+)\."
            for m in re.finditer(pattern, second):
                name, again, value = m.groups()
                assert name == again and name in NAMES
                assert statement.format(n=name, v=value) in first  # stated before, in the first half
                answered += 1
        assert answered == 4  # two groups, two asked each
        assert text.count("~") == len(text) - sum(len(b) for b in re.findall(r"\n[^~]*\n", text))


def _answers(second: str) -> list[tuple[int, str]]:
    """(offset, value) of every answer in a row's second half."""
    found = []
    for _, question, lead, _ in ATTRIBUTES:
        pattern = re.escape(question).replace(re.escape("{n}"), r"\w+") + " " + \
            re.escape(lead).replace(re.escape("{n}"), r"\w+") + r" (\w+)\."
        found += [(m.start(1), m.group(1)) for m in re.finditer(pattern, second)]
    return sorted(found)


def test_answer_mask_marks_exactly_the_answers_values():
    """answers=True: the same rows, and a mask that holds each answer's value with the space before it (a
    word's token in the tokenizers of real models: " white") and nothing else."""
    tok = CharTokenizer()
    ids = torch.full((4, 2048), ord("~"))
    out, mask = with_stated_facts(ids, tok, seed=3, groups=3, answers=True)
    assert torch.equal(out, with_stated_facts(ids, tok, seed=3, groups=3))
    for row, marked in zip(out, mask):
        text = _text(row)
        answers = _answers(text[1024:])
        assert len(answers) == 6
        expect = torch.zeros(len(text), dtype=torch.bool)
        for at, value in answers:
            expect[1024 + at - 1 : 1024 + at + len(value)] = True
        assert torch.equal(marked, expect)


def test_answer_tokens_leaves_a_value_that_shares_a_token_with_its_lead():
    """A span whose edge falls inside a token (here "ab" is one token) is not marked; one on token edges is."""

    class MergingTokenizer(CharTokenizer):
        def __call__(self, text, add_special_tokens=False):
            ids = []
            i = 0
            while i < len(text):
                if text.startswith("ab", i):
                    ids, i = ids + [1000], i + 2
                else:
                    ids, i = ids + [ord(text[i])], i + 1
            return {"input_ids": ids}

    tok = MergingTokenizer()
    text = "xab yz"
    ids = torch.tensor(tok(text)["input_ids"])  # x, ab, ' ', y, z
    assert answer_tokens(tok, text, ids, [(2, 3)]).tolist() == [False] * 5  # "b": inside the token "ab"
    assert answer_tokens(tok, text, ids, [(1, 3), (4, 6)]).tolist() == [False, True, False, True, True]


def test_too_short_rows_stay_as_they_are():
    tok = CharTokenizer()
    ids = torch.full((2, 200), ord("~"))
    assert torch.equal(with_stated_facts(ids, tok, seed=0), ids)


def test_nothing_of_the_recall_task_is_in_the_facts():
    """Healing on these facts cannot learn the recall task's items: no surname, city or phrasing of it."""
    words = set(NAMES) | {w for a in ATTRIBUTES for w in a[3]}
    assert not words & (set(SURNAMES) | set(CITIES))
    assert not any("lives in" in a[0] or "Mr." in a[0] for a in ATTRIBUTES)


def test_training_data_carries_the_facts(tmp_path):
    """data.stated_facts: the training sequences are with_stated_facts of the plain ones (the recipe's
    seed), their labels the next token of the changed text."""
    from transmla.finetune.recipe import parse_recipe
    from transmla.finetune.train import _training_data

    train = tmp_path / "train.txt"
    train.write_text("plain words of prose " * 2000)
    tok = CharTokenizer()
    tok.pad_token_id = 0

    def data(**extra):
        recipe = {"model": {"path": "m"}, "train": {"steps": 1}, "output_dir": str(tmp_path / "o"),
                  "data": {"train": str(train), "documents": "none", "seq_len": 1024, **extra}}
        return _training_data(parse_recipe(recipe, "r"), tok)

    plain, facts = data(), data(stated_facts=2)
    assert torch.equal(facts.input_ids, with_stated_facts(plain.input_ids, tok, 0, groups=2))
    assert not torch.equal(facts.input_ids, plain.input_ids)
    assert torch.equal(facts.labels[:, :-1], facts.input_ids[:, 1:])
    assert facts.weights is None and "weights" not in facts.batch(torch.tensor([0]))
    # data.answer_weight: the labels that are an answer's value count that many times, the rest once
    weighted = data(stated_facts=2, answer_weight=5)
    assert torch.equal(weighted.input_ids, facts.input_ids)
    _, answers = with_stated_facts(plain.input_ids, tok, 0, groups=2, answers=True)
    assert torch.equal(weighted.weights[:, :-1] == 5, answers[:, 1:])
    assert set(weighted.weights.unique().tolist()) == {1.0, 5.0}
    assert torch.equal(weighted.batch(torch.tensor([1, 0]))["weights"], weighted.weights[[1, 0]])


def test_training_data_refuses_facts_that_do_not_fit(tmp_path):
    """Sequences too short for the asked groups: a one-line error, not silently plain text."""
    from transmla.finetune.recipe import parse_recipe
    from transmla.finetune.train import _training_data

    train = tmp_path / "train.txt"
    train.write_text("plain words of prose " * 200)
    tok = CharTokenizer()
    tok.pad_token_id = 0
    recipe = {"model": {"path": "m"}, "train": {"steps": 1}, "output_dir": str(tmp_path / "o"),
              "data": {"train": str(train), "documents": "none", "seq_len": 128, "stated_facts": 4}}
    with pytest.raises(ValueError) as e:
        _training_data(parse_recipe(recipe, "r"), tok)
    assert "data.stated_facts: 4 groups" in str(e.value) and "\n" not in str(e.value)


def test_weighted_loss_sums():
    """The KL and the NLL summed over scored tokens, each times its weight: weights of 1 give the plain sums."""
    import torch.nn.functional as F

    from transmla.finetune.data import IGNORE
    from transmla.finetune.distill import scored_kl_sum, scored_nll_sum, token_kl

    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 5, 7, generator=g), torch.randn(2, 5, 7, generator=g)
    labels = torch.randint(0, 7, (2, 5), generator=g)
    labels[0, -1] = labels[1, 2] = IGNORE
    w = torch.rand(2, 5, generator=g) + 1
    per_token = token_kl(s.flatten(0, 1), t.flatten(0, 1), 2.0).view(2, 5)
    scored = labels != IGNORE
    assert torch.allclose(scored_kl_sum(s, t, labels, 2.0, torch.ones(2, 5)), scored_kl_sum(s, t, labels, 2.0))
    assert torch.allclose(scored_kl_sum(s, t, labels, 2.0, w), (per_token * w)[scored].sum())
    nll = -torch.log_softmax(s, -1).gather(-1, labels.clamp_min(0)[..., None])[..., 0]  # [2, 5]
    assert torch.allclose(scored_nll_sum(s, labels), nll[scored].sum())
    assert torch.allclose(scored_nll_sum(s, labels), F.cross_entropy(s.flatten(0, 1), labels.flatten(), ignore_index=IGNORE,
                                                                     reduction="sum"))
    assert torch.allclose(scored_nll_sum(s, labels, w), (nll * w)[scored].sum())
