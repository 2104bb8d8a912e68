"""Passkey retrieval (transmla.eval.passkey, `transmla eval --task passkey`)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from conftest import make_tiny_model, word_level_tokenizer
from transmla.eval import passkey as pk

# --- a word-level tokenizer that can write a passkey prompt ------------------------------------

FILLER_WORDS = [f"w{i}" for i in range(60)]
PROMPT_WORDS = sorted({w for text in (pk.INSTRUCTION, pk.NEEDLE, pk.QUESTION) for w in re.findall(r"[A-Za-z]+", text)})
VOCAB = FILLER_WORDS + PROMPT_WORDS + list("0123456789") + [".", "?", "{", "}", "[UNK]"]


def word_tokenizer(path=None):
    """Words, digits one by one and punctuation; decoding fuses the tokens (no spaces), so a key
    written as five digit tokens decodes back to the key."""
    return word_level_tokenizer(VOCAB, path, digits=True, decoder="fuse")


def filler_file(path, paragraphs=40, seed=0):
    """Paragraphs of sentences of filler words (no digits), one per line."""
    g = torch.Generator().manual_seed(seed)
    lines = []
    for _ in range(paragraphs):
        sentences = []
        for _ in range(int(torch.randint(2, 6, (1,), generator=g))):
            n = int(torch.randint(4, 12, (1,), generator=g))
            sentences.append(" ".join(FILLER_WORDS[int(i)] for i in torch.randint(0, 60, (n,), generator=g)) + " .")
        lines.append(" ".join(sentences))
    path.write_text("\n".join(lines) + "\n")
    return path


def find(seq: list[int], sub: list[int]) -> list[int]:
    return [i for i in range(len(seq) - len(sub) + 1) if seq[i : i + len(sub)] == sub]


def check_prompt(tokenizer, prompt: pk.PasskeyPrompt, length: int, depth: float) -> None:
    """Exact length, the needle once (the key nowhere else), where asked, instruction first, question last."""
    ids = prompt.ids.tolist()
    assert len(ids) == length
    needle = tokenizer(pk.NEEDLE.format(key=prompt.key), add_special_tokens=False)["input_ids"]
    assert find(ids, needle) == [prompt.needle_start]
    text = tokenizer.decode(ids)
    assert text.count(prompt.key) == 2  # "The pass key is K. Remember it. K is the pass key." and nowhere else
    window = min(pk.SNAP_TOKENS, length // 50) + 1
    assert abs(prompt.needle_start - depth / 100 * length) <= window, (prompt.needle_start, depth, length)
    head = tokenizer(pk.INSTRUCTION, add_special_tokens=False)["input_ids"]
    question = tokenizer(pk.QUESTION, add_special_tokens=False)["input_ids"]
    assert ids[: len(head)] == head and ids[-len(question) :] == question


# --- settings ------------------------------------------------------------------------------------


def test_parse_lengths_and_depths():
    assert pk.parse_lengths("1K, 2k,4096,1024") == [1024, 2048, 4096]
    assert pk.parse_depths("90,10,50") == [10.0, 50.0, 90.0]
    for bad in ("0", "100", "-5", "150", "x"):
        with pytest.raises(ValueError, match="depths must"):
            pk.parse_depths(bad)
    for bad in ("1M", "", "0", "two"):
        with pytest.raises(ValueError, match="lengths must"):
            pk.parse_lengths(bad)
    with pytest.raises(ValueError, match="keys must be at least 1"):
        pk.PasskeySettings(keys=0)


def test_default_lengths_follow_the_context():
    assert pk.default_lengths(8192) == [1024, 2048, 4096, 8192]
    assert pk.default_lengths(32768) == [1024, 2048, 4096, 8192]
    assert pk.default_lengths(3000) == [1024, 2048]
    assert pk.default_lengths(256) == [256]


# --- prompts ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [400, 517, 1000])
@pytest.mark.parametrize("depth", [10.0, 50.0, 90.0])
def test_prompt_exact_length_needle_once_at_depth(tmp_path, length, depth):
    tok = word_tokenizer()
    paragraphs = pk.filler_paragraphs(str(filler_file(tmp_path / "f.txt")))
    prompt = pk.build_prompt(tok, paragraphs, length, depth, "41729", start_paragraph=3)
    check_prompt(tok, prompt, length, depth)


def test_prompt_needle_starts_a_sentence_and_filler_is_the_text(tmp_path):
    """The needle follows a sentence end, and the filler around it is the text itself, in order."""
    tok = word_tokenizer()
    paragraphs = pk.filler_paragraphs(str(filler_file(tmp_path / "f.txt")))
    prompt = pk.build_prompt(tok, paragraphs, 400, 50, "12345", start_paragraph=5)
    ids = prompt.ids.tolist()
    before = ids[prompt.needle_start - 1]
    assert tok.convert_ids_to_tokens(before) == "."
    head = len(tok(pk.INSTRUCTION, add_special_tokens=False)["input_ids"])
    question = len(tok(pk.QUESTION, add_special_tokens=False)["input_ids"])
    filler = ids[head : prompt.needle_start] + ids[prompt.needle_start + prompt.needle_tokens : -question]
    expected = tok("\n".join(paragraphs[5:]), add_special_tokens=False)["input_ids"][: len(filler)]
    assert filler == expected


def test_too_short_a_prompt_is_refused(tmp_path):
    tok = word_tokenizer()
    paragraphs = pk.filler_paragraphs(str(filler_file(tmp_path / "f.txt")))
    with pytest.raises(ValueError, match="lengths must be at least"):
        pk.build_prompt(tok, paragraphs, 20, 50, "12345")


def test_trials_are_seeded_and_vary_key_and_filler():
    a = pk.trials([256, 512], [10, 90], keys=3, seed=0, paragraphs=1000)
    assert a == pk.trials([256, 512], [10, 90], keys=3, seed=0, paragraphs=1000)
    assert a != pk.trials([256, 512], [10, 90], keys=3, seed=1, paragraphs=1000)
    assert len(a) == 12 and all(len(t.key) == 5 and t.key.isdigit() for t in a)
    assert len({t.key for t in a}) > 9 and len({t.start_paragraph for t in a}) > 9


def test_filler_refuses_unknown_text():
    with pytest.raises(ValueError, match="neither a built-in text"):
        pk.filler_paragraphs("nosuchtext")


# --- scoring ----------------------------------------------------------------------------------------


def test_found_is_the_key_in_the_continuation():
    assert pk.found(" 41729. Remember", "41729")
    assert not pk.found(" 4172", "41729")
    assert not pk.found(" a secret", "41729")


def _key_in(tok, ids: torch.Tensor) -> str:
    m = re.search(r"passkeyis(\d{5})", tok.decode(ids.tolist()))
    return m.group(1) if m else "none"


def test_run_passkey_scores_what_the_answerer_sees(tmp_path):
    """An answerer that reads the whole prompt finds every key; one that sees only the last tokens finds
    exactly the keys placed within them; one that answers a fixed number finds none."""
    tok = word_tokenizer()
    settings = pk.PasskeySettings(depths="10,50,90", keys=2, filler=str(filler_file(tmp_path / "f.txt")))
    full = pk.run_passkey(lambda ids: _key_in(tok, ids), tok, settings, [400, 600], progress=False)
    assert full["found"] == full["keys"] == 12 and full["accuracy"] == 1.0
    assert len(full["cells"]) == 6 and all(c["keys"] == 2 and c["seconds"] >= 0 for c in full["cells"])

    recent = 90  # tokens the short-memory answerer sees: only the needles at 90% lie within them
    short = pk.run_passkey(lambda ids: _key_in(tok, ids[-recent:]), tok, settings, [400, 600], progress=False)
    by_cell = {(c["length"], c["depth"]): c["found"] for c in short["cells"]}
    assert by_cell == {(400, 10.0): 0, (400, 50.0): 0, (400, 90.0): 2, (600, 10.0): 0, (600, 50.0): 0, (600, 90.0): 2}

    none = pk.run_passkey(lambda ids: " 00000", tok, settings, [400], progress=False)
    assert none["found"] == 0 and none["accuracy"] == 0.0


def test_greedy_answer_through_the_cache_equals_recomputing(tmp_path):
    """The answer generate() gives through the model's own cache is the argmax of full forwards."""
    tok = word_tokenizer()
    net = make_tiny_model("llama", vocab_size=len(VOCAB))
    paragraphs = pk.filler_paragraphs(str(filler_file(tmp_path / "f.txt")))
    prompt = pk.build_prompt(tok, paragraphs, 200, 50, "55555", start_paragraph=1)
    answer = pk.greedy_answerer(net, tok, 6)(prompt.ids)
    ids = prompt.ids[None]
    with torch.no_grad():
        for _ in range(6):
            ids = torch.cat([ids, net(ids).logits[:, -1:].argmax(-1)], dim=1)
    assert answer == tok.decode(ids[0, 200:].tolist())


# --- the CLI ------------------------------------------------------------------------------------------


@pytest.fixture
def passkey_model(tmp_path):
    src = tmp_path / "src"
    make_tiny_model("llama", src, vocab_size=len(VOCAB))
    word_tokenizer(src)
    return src, filler_file(tmp_path / "filler.txt")


def test_cli_passkey_json_and_report(cli, tmp_path, passkey_model):
    src, filler = passkey_model
    args = ("eval", src, "--task", "passkey", "--lengths", "128,256", "--depths", "25,75", "--keys", "2",
            "--filler", filler, "--answer-tokens", "4")
    code, out, err = cli(*args, "--json")
    assert code == 0, err
    result = json.loads(out)
    (entry,) = result["models"]
    assert entry["lengths"] == [128, 256] and entry["depths"] == [25.0, 75.0] and entry["context"] == 256
    assert sorted((c["length"], c["depth"]) for c in entry["cells"]) == [(128, 25.0), (128, 75.0), (256, 25.0), (256, 75.0)]
    for c in entry["cells"]:
        assert c["keys"] == 2 and c["found"] == sum(t["found"] for t in c["trials"]) and c["seconds"] > 0
        for t in c["trials"]:
            assert t["found"] == (t["key"] in t["answer"])
            assert abs(t["needle_depth"] - c["depth"]) < 4
    assert entry["found"] == sum(c["found"] for c in entry["cells"]) and entry["keys"] == 8

    report = tmp_path / "rep"
    code, out, err = cli(*args, "--compare", src, "--report", report)
    assert code == 0, err
    assert "source found" in out and "converted found" in out and "all" in out
    data = json.loads((report / "passkey.json").read_text())
    source, converted = data["models"]
    assert source["role"] == "source" and converted["role"] == "converted"
    # the same model, the same seeded prompts: the same answers, and the same as the run before
    assert [t["answer"] for c in source["cells"] for t in c["trials"]] == \
        [t["answer"] for c in converted["cells"] for t in c["trials"]] == \
        [t["answer"] for c in entry["cells"] for t in c["trials"]]
    md = (report / "passkey.md").read_text()
    assert "| 128 | 25% |" in md and "passkey.png" in md
    assert (report / "passkey.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_passkey_on_a_converted_model(cli, tmp_path, passkey_model):
    """A converted (MLA) model answers through its latent cache."""
    src, filler = passkey_model
    out_dir = tmp_path / "mla"
    code, _, err = cli("convert", src, out_dir, "--method", "transmla", "--kv-budget", "0.5", "--calib", filler,
                       "--calib-samples", "8", "--calib-seq-len", "16", "--device", "cpu")
    assert code == 0, err
    code, out, err = cli("eval", out_dir, "--task", "passkey", "--lengths", "200", "--depths", "50", "--keys", "1",
                         "--filler", filler, "--compare", src, "--json")
    assert code == 0, err
    source, converted = json.loads(out)["models"]
    assert source["attention"] == "MHA/GQA" and converted["attention"] == "MLA"
    assert converted["cells"][0]["trials"][0]["key"] == source["cells"][0]["trials"][0]["key"]


@pytest.mark.parametrize("flags, message", [
    (("--task", "passkey", "--lengths", "512"), "--lengths must fit"),
    (("--task", "passkey", "--depths", "0,50"), "--depths must lie strictly between 0 and 100"),
    (("--task", "passkey", "--depths", "100"), "--depths must lie strictly between 0 and 100"),
    (("--task", "passkey", "--keys", "0"), "--keys must be at least 1"),
    (("--task", "passkey", "--lengths", "2x"), "--lengths must be token counts"),
    (("--task", "passkey", "--filler", "nosuch"), "neither a built-in text"),
    (("--task", "quiz",), "--task must be perplexity, passkey, cloze, recall or code"),
    (("--depths", "50"), "--depths applies to --task passkey only"),
])
def test_cli_passkey_bad_input(cli, passkey_model, flags, message):
    src, filler = passkey_model
    code, out, err = cli("eval", src, *flags)
    assert code == 1 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err


# --- the real built-in model --------------------------------------------------------------------------


@pytest.mark.slow
def test_prompts_with_the_smollm2_tokenizer():
    """Real filler (wiki and lee evaluation parts) under the real tokenizer: exact lengths, the needle
    once at its depth, right after a sentence end, different prose for every key."""
    from transmla.checkpoint.resolve import resolve_model_dir
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m"))
    paragraphs = pk.filler_paragraphs("wiki,lee")
    assert len(paragraphs) > 100
    fillers = set()
    for t in pk.trials([1024, 2048, 4096, 8192], [10, 50, 90], keys=2, seed=0, paragraphs=len(paragraphs)):
        prompt = pk.build_prompt(tok, paragraphs, t.length, t.depth, t.key, t.start_paragraph)
        check_prompt(tok, prompt, t.length, t.depth)
        assert re.search(r"[.!?:;\n][\"')\]]*\s*$", tok.decode(prompt.ids[: prompt.needle_start][-2:].tolist()))
        fillers.add(tuple(prompt.ids[40:60].tolist()))
    assert len(fillers) == 24


@pytest.mark.slow
def test_smollm2_source_finds_a_key_at_1k(cli):
    code, out, err = cli("eval", "smollm2-135m", "--task", "passkey", "--lengths", "1K", "--depths", "50",
                         "--keys", "2", "--json")
    assert code == 0, err
    (entry,) = json.loads(out)["models"]
    assert entry["found"] >= 1, entry["cells"]


def test_rows_total_only_the_cells_every_model_has():
    def cell(n, d, f):
        return {"length": n, "depth": d, "found": f, "keys": 3, "seconds": 1.0}

    source = {"role": "source", "cells": [cell(1024, 10.0, 3), cell(1024, 90.0, 2), cell(2048, 10.0, 1)]}
    model = {"role": "model", "cells": [cell(1024, 10.0, 1), cell(1024, 90.0, 0)]}
    header, rows = pk.passkey_rows([source, model])
    assert header == ["length", "depth", "source found", "model found", "source s", "model s"]
    assert rows[0] == ["1K", "10%", "3/3", "1/3", "1.0", "1.0"]
    assert ["2K", "10%", "1/3", "", "1.0", ""] in rows
    assert rows[-1] == ["common cells", "", "5/6 (83%)", "1/6 (17%)", "2", "2"]
    assert pk.passkey_rows([source])[1][-1] == ["all", "", "6/9 (67%)", "3"]
