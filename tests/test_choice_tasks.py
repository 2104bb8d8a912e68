"""Multiple-choice tasks from installed text (transmla.eval.choice_tasks, `transmla eval --task cloze|recall`)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from conftest import make_tiny_model, word_level_tokenizer
from transmla.eval import choice_tasks as ct

FILLER = [f"w{i}" for i in range(40)]
WORDS = sorted(set(FILLER) | set(ct.SURNAMES) | set(ct.CITIES)
               | set(re.findall(r"[A-Za-z]+", "Remember where each person lives. Mr. lives in Where does live?"))
               | {"A", "B", "C", "D", "E", "F", "G", "H"})
VOCAB = WORDS + [".", "?", "[UNK]"]


def tokenizer(path=None):
    return word_level_tokenizer(VOCAB, path)


def text_file(path, paragraphs=30, seed=0):
    """Paragraphs of 3-6 sentences, each sentence opening with a capital word (A..H) then filler words."""
    g = torch.Generator().manual_seed(seed)
    lines = []
    for _ in range(paragraphs):
        sentences = []
        for _ in range(int(torch.randint(3, 7, (1,), generator=g))):
            n = int(torch.randint(4, 10, (1,), generator=g))
            first = "ABCDEFGH"[int(torch.randint(0, 8, (1,), generator=g))]
            sentences.append(first + " " + " ".join(FILLER[int(i)] for i in torch.randint(0, 40, (n,), generator=g)) + " .")
        lines.append(" ".join(sentences))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_cloze_items_hold_the_true_next_sentence(tmp_path):
    tok, texts = tokenizer(), text_file(tmp_path / "t.txt")
    settings = ct.ChoiceSettings(items=20, context_tokens=64, texts=str(texts))
    items = ct.cloze_items(tok, settings)
    norm = lambda x: re.sub(r"\s+([.?])", r"\1", x)  # noqa: E731  (the decoder joins punctuation)
    whole = [norm(" ".join(line.split())) for line in texts.read_text().splitlines()]
    answers = []
    for item in items:
        assert len(item.candidates) == 4 and 0 <= item.answer < 4 and len(item.context) <= 64
        context = tok.decode(item.context)
        truth = tok.decode(item.candidates[item.answer]).strip()
        assert any(context[-40:] in p and (context[-40:] + " " + truth) in p for p in whole)  # truth follows the context
        others = [tok.decode(c).strip() for k, c in enumerate(item.candidates) if k != item.answer]
        assert all(o != truth and not any((context[-40:] + " " + o) in p for p in whole) for o in others)
        answers.append(item.answer)
    assert len(set(answers)) > 1  # the true one is not always in the same place
    again = ct.cloze_items(tok, settings)
    assert [(i.context, i.candidates, i.answer) for i in again] == [(i.context, i.candidates, i.answer) for i in items]


def test_recall_items_state_each_fact_once_far_from_the_question(tmp_path):
    tok, texts = tokenizer(), text_file(tmp_path / "t.txt")
    settings = ct.ChoiceSettings(items=10, context_tokens=200, texts=str(texts), choices=5)
    for item in ct.recall_items(tok, settings):
        text = tok.decode(item.context)
        facts = dict(re.findall(r"Mr\. (\w+) lives in (\w+)\.", text))
        asked = re.search(r"Where does Mr\. (\w+) live\? Mr\. \w+ lives in$", text).group(1)
        cities = [tok.decode(c).strip() for c in item.candidates]
        assert len(facts) == 5 and sorted(cities) == sorted(facts.values())
        assert cities[item.answer] == facts[asked]
        assert all(text.count(c) == 1 for c in cities)  # each city named once, at the start
        assert len(item.context) > 200


def test_score_items_is_the_argmax_of_the_log_likelihoods(tmp_path, monkeypatch):
    items = [ct.ChoiceItem([1], [[2], [3, 4]], 0, [10, 2]), ct.ChoiceItem([1], [[2], [3, 4]], 1, [10, 2])]
    monkeypatch.setattr(ct, "candidate_loglik", lambda net, context, cands: [-4.0, -6.0])
    r = ct.score_items(None, items)
    assert (r["acc"], r["acc_norm"], r["chance"]) == (0.5, 0.5, 0.5)  # acc picks 0; per character picks 1 (-0.4 < -3)
    share = torch.tensor(1.0) / (1 + torch.exp(torch.tensor(-2.0)))  # the first candidate's share of the likelihood
    assert r["nll"] == pytest.approx(float(-(share.log() + (1 - share).log()) / 2))


@pytest.fixture(scope="module")
def choice_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("choice")
    make_tiny_model("llama", root / "src", vocab_size=len(VOCAB))
    tokenizer(root / "src")
    text_file(root / "t.txt")
    from transmla.convert.api import convert
    from transmla.convert.options import ConvertOptions

    convert(str(root / "src"), root / "mla", ConvertOptions.of(method="lossless"), progress=False)
    return root


@pytest.mark.parametrize("which", ["src", "mla"])
def test_cached_loglik_equals_one_full_pass_per_candidate(choice_model, which):
    """The context's cache (the latent cache for the MLA model), repeated per candidate and fed the
    right-padded candidates, gives each candidate's sum of one full pass without a cache."""
    from transmla.checkpoint.resolve import load_model

    net, _ = load_model(str(choice_model / which), dtype=torch.float32)
    context = [3, 7, 11, 5, 2, 8, 13, 6]
    for cands in ([[4], [9, 10, 12], [1, 1], [14, 2, 9, 3]], [[4], [9]]):  # the second: no step after the context
        cached = ct.candidate_loglik(net, context, cands)
        for cand, value in zip(cands, cached):
            with torch.no_grad():
                logp = torch.log_softmax(net(torch.tensor([context + cand])).logits[0].float(), -1)
            alone = sum(logp[len(context) - 1 + k, t].item() for k, t in enumerate(cand))
            assert value == pytest.approx(alone, rel=1e-5, abs=1e-5)
    with pytest.raises(ValueError, match="non-empty"):
        ct.candidate_loglik(net, context, [[4], []])


@pytest.mark.parametrize("task", ["cloze", "recall"])
def test_cli_task_scores_a_converted_model_beside_its_source(cli, choice_model, task):
    """A lossless conversion answers every item as its source does (same items, exact model)."""
    code, out, err = cli("eval", choice_model / "mla", "--compare", choice_model / "src", "--task", task,
                         "--items", 6, "--context-tokens", 48, "--texts", choice_model / "t.txt", "--json")
    assert code == 0, err
    result = json.loads(out)
    source, converted = result["models"]
    assert result["task"] == task and (source["role"], converted["role"]) == ("source", "converted")
    assert source["items"] == converted["items"] == 6
    assert (source["acc"], source["acc_norm"]) == (converted["acc"], converted["acc_norm"])


@pytest.mark.parametrize("flags, message", [
    (("--task", "cloze", "--keys", "2"), "--keys applies to --task passkey only"),
    (("--items", "3"), "--items applies to --task cloze, recall or code only"),
    (("--task", "code", "--texts", "lee"), "--texts applies to --task cloze or recall only"),
    (("--task", "recall", "--choices", "1"), "choices must be between 2"),
    (("--task", "cloze", "--items", "0"), "items must be at least 1"),
    (("--task", "quiz",), "--task must be perplexity, passkey, cloze, recall or code"),
    (("--task", "cloze", "--report", "rep"), "--report applies to --task perplexity or passkey only"),
])
def test_cli_bad_input_is_one_line(cli, choice_model, flags, message):
    code, out, err = cli("eval", choice_model / "mla", *flags)
    lines = err.strip().splitlines()
    assert code == 1 and out == "" and len(lines) == 1 and message in lines[0], err


def test_sweep_scores_the_tasks_beside_perplexity(cli, choice_model, tmp_path):
    """sweep --tasks: every model's accuracy in sweep.json, its table and sweep.md, each equal to
    `transmla eval --task` on the kept model; without --tasks no task key is written."""
    out = tmp_path / "sweep"
    text = choice_model / "t.txt"
    common = ("--method", "transmla", "--budgets", "0.5", "--data", text, "--seq-len", 16, "--max-windows", 2,
              "--calib", text, "--calib-samples", 4, "--calib-seq-len", 16, "--fit-steps", 0)
    task_flags = ("--items", 5, "--context-tokens", 40, "--texts", text)
    code, stdout, err = cli("sweep", choice_model / "src", "--out", out, *common, "--tasks", "cloze,recall",
                            *task_flags, "--keep", "--json")
    assert code == 0, err
    result = json.loads(stdout)
    row = result["rows"][0]
    assert set(result["source"]["tasks"]) == set(row["tasks"]) == {"cloze", "recall"}
    assert result["task_settings"]["items"] == 5
    for task in ("cloze", "recall"):
        code, again, err = cli("eval", row["model_dir"], "--task", task, *task_flags, "--json")
        assert code == 0, err
        assert json.loads(again)["models"][0]["acc"] == row["tasks"][task]
    md = (out / "sweep.md").read_text()
    assert "| perplexity | cloze acc | recall acc | vs source |" in md
    code, stdout, err = cli("sweep", choice_model / "src", "--out", tmp_path / "plain", *common, "--json")
    assert code == 0, err
    plain = json.loads(stdout)
    assert "tasks" not in plain["source"] and "tasks" not in plain["rows"][0] and "task_settings" not in plain
    code, _, err = cli("sweep", choice_model / "src", "--out", tmp_path / "bad", *common, "--items", 3)
    assert code == 1 and "--items needs --tasks" in err
