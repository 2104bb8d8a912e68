"""data.facts.with_stated_facts: stated facts written over training text, asked later (issue 34)."""

from __future__ import annotations

import re

import pytest
import torch

from transmla.data.facts import ATTRIBUTES, NAMES, with_stated_facts
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
