"""Built-in texts, local files, dataset specs and calibration chunks."""

from __future__ import annotations

import json
import time

import pytest
import torch

from transmla.data.calib import calibration_chunks, calibration_mix, picked_chunks, split_samples, with_repeated_span
from transmla.data.texts import TextSourceError, builtin_text, load_text


@pytest.mark.parametrize("name", ["wiki", "lee"])
def test_builtin_split(name):
    calib, ev, whole = (builtin_text(name, p) for p in ("calib", "eval", "all"))
    assert calib + ev == whole  # disjoint, contiguous, eval is the tail
    assert len(calib) == int(0.8 * len(whole))
    assert whole.endswith(ev) and not whole.startswith(ev)
    assert load_text(name) == ev and load_text(name, part="calib") == calib


def test_wiki_protocol():
    whole = builtin_text("wiki", "all")
    assert 2.5e6 <= len(whole.encode("utf-8")) <= 3.5e6
    assert whole.startswith(" = ")
    assert whole.count("\n = ") >= 50  # one heading per article, each after a blank line
    assert "'''" not in whole and "''" not in whole  # bold / italic quotes removed
    assert "{|" not in whole and "\n|" not in whole  # table markup lines removed
    assert "#REDIRECT" not in whole


def test_lee_text():
    whole = builtin_text("lee", "all")
    assert 3e5 <= len(whole) <= 4e5
    assert whole.startswith("Hundreds of people")


def test_code_text_splits_by_module():
    import sysconfig
    from pathlib import Path

    calib, ev, whole = (builtin_text("code", p) for p in ("calib", "eval", "all"))
    assert calib + ev == whole
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    # each module sits whole in exactly one part: abc.py (a..m) calibrates, string.py (n..z) evaluates
    abc_src, string_src = ((stdlib / n).read_text(encoding="utf-8") for n in ("abc.py", "string.py"))
    assert abc_src in calib and abc_src not in ev
    assert string_src in ev and string_src not in calib
    assert load_text("code") == ev and load_text("code", part="calib") == calib


def test_builtin_cached():
    assert builtin_text("wiki", "eval") is builtin_text("wiki", "eval")


def test_bad_part():
    with pytest.raises(ValueError, match="part"):
        load_text("lee", part="test")


def test_txt_file(tmp_path):
    p = tmp_path / "doc.txt"
    p.write_text("héllo\nworld\n", encoding="utf-8")
    assert load_text(str(p)) == "héllo\nworld\n"
    assert load_text(str(p), part="calib") == "héllo\nworld\n"  # whole file for any part


def test_jsonl_file(tmp_path):
    p = tmp_path / "docs.jsonl"
    rows = [{"text": "first", "id": 1}, {"text": "second", "id": 2}]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    assert load_text(str(p)) == "first\n\nsecond"
    assert load_text(str(p), text_field="id") == "1\n\n2"
    with pytest.raises(TextSourceError, match="'body'"):
        load_text(str(p), text_field="body")


def test_missing_file(tmp_path):
    with pytest.raises(TextSourceError, match="no such file"):
        load_text(str(tmp_path / "nope.txt"))
    with pytest.raises(TextSourceError, match="no such file"):
        load_text("./nope")


def test_unknown_dataset_fails_fast(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    t0 = time.perf_counter()
    with pytest.raises(TextSourceError) as err:
        load_text("surely-not-a-dataset-xyz:cfg:test")
    assert time.perf_counter() - t0 < 30
    msg = str(err.value)
    assert "\n" not in msg and "could not fetch" in msg
    assert "wiki" in msg and "lee" in msg and "local" in msg
    with pytest.raises(TextSourceError, match="could not fetch"):
        load_text("wikitext-2-raw-v1")


class _CharTokenizer:
    """One token per character (enough text for chunking tests without a vocabulary)."""

    def __call__(self, text, add_special_tokens=True, verbose=True):
        return {"input_ids": [ord(c) % 1000 for c in text]}


def test_calibration_chunks(tmp_path):
    tok = _CharTokenizer()
    a = calibration_chunks(tok, "lee", n_samples=8, seq_len=64, seed=0)
    b = calibration_chunks(tok, "lee", n_samples=8, seq_len=64, seed=0)
    c = calibration_chunks(tok, "lee", n_samples=8, seq_len=64, seed=1)
    assert a.shape == (8, 64) and a.dtype == torch.long
    assert torch.equal(a, b) and not torch.equal(a, c)
    # every chunk is an aligned slice of the calibration stream, in text order, no repeats
    ids = torch.tensor(tok(load_text("lee", part="calib"))["input_ids"])
    starts = []
    for row in a:
        hits = [i for i in range(0, ids.numel() - 63, 64) if torch.equal(ids[i : i + 64], row)]
        assert hits
        starts.append(hits[0])
    assert starts == sorted(set(starts))


def test_picked_chunks_are_the_chunks_taken_and_grow_by_superset():
    """picked_chunks names calibration_chunks' chunks (what benchmarks use to keep dev windows off calibration
    text), and a larger count takes every chunk of a smaller one (the same seeded permutation)."""
    tok = _CharTokenizer()
    ids = torch.tensor(tok(load_text("lee", part="calib"))["input_ids"])
    n_chunks = ids.numel() // 64
    pick = picked_chunks(n_chunks, 8, seed=3)
    assert torch.equal(calibration_chunks(tok, "lee", 8, 64, seed=3), ids[: n_chunks * 64].view(n_chunks, 64)[pick])
    assert set(pick.tolist()) < set(picked_chunks(n_chunks, 16, seed=3).tolist())


def test_calibration_chunks_too_few(tmp_path):
    p = tmp_path / "small.txt"
    p.write_text("x" * 100, encoding="utf-8")
    with pytest.raises(ValueError, match="has 3 chunks"):
        calibration_chunks(_CharTokenizer(), str(p), n_samples=4, seq_len=32)


def test_calibration_mix_takes_each_texts_share(tmp_path):
    # wiki=3,a.txt=1: 6 + 2 of 8 sequences, each text's chunks picked as if it were alone, in the order given.
    tok = _CharTokenizer()
    a = tmp_path / "a.txt"
    a.write_text("".join(chr(65 + i % 26) for i in range(4000)), encoding="utf-8")
    mixed = calibration_chunks(tok, f"wiki=3,{a}=1", n_samples=8, seq_len=32, seed=0)
    assert mixed.shape == (8, 32)
    assert torch.equal(mixed[:6], calibration_chunks(tok, "wiki", n_samples=6, seq_len=32, seed=0))
    assert torch.equal(mixed[6:], calibration_chunks(tok, str(a), n_samples=2, seq_len=32, seed=0))
    # weights are relative and default to 1; at least one sequence each
    assert calibration_mix("wiki,lee") == [("wiki", 1.0), ("lee", 1.0)]
    assert split_samples(2048, [3, 1]) == [1536, 512] and split_samples(10, [1, 1, 1]) == [4, 3, 3]
    assert split_samples(3, [100, 1, 1]) == [1, 1, 1]
    assert calibration_mix(str(a)) == [(str(a), 1.0)]  # one file is one text
    assert calibration_mix("wikitext:wikitext-2-raw-v1:train=2,lee") == [("wikitext:wikitext-2-raw-v1:train", 2.0), ("lee", 1.0)]


@pytest.mark.parametrize("spec, message", [
    ("wiki=0,lee", "positive weight"), ("wiki=x,lee", "positive weight"), ("wiki,,lee", "positive weight"),
    ("wiki,wiki=2", "names 'wiki' twice"), ("wiki=nan,lee", "positive weight"),
])
def test_calibration_mix_bad_specs(spec, message):
    with pytest.raises(ValueError, match=message):
        calibration_mix(spec)
    with pytest.raises(ValueError, match="cannot be shared by 3 texts"):
        split_samples(2, [1, 1, 1])


def test_with_repeated_span_copies_one_span_later_in_each_sequence():
    """Each fit sequence gets exactly one span of 32..128 tokens written again later in it; token 0 (the
    sink) and every other token stay; the same seed gives the same sequences; too short: unchanged."""
    ids = torch.arange(4 * 1024).view(4, 1024)  # every token distinct: a copy is visible
    out = with_repeated_span(ids, seed=3)
    assert torch.equal(out, with_repeated_span(ids, seed=3)) and not torch.equal(out, with_repeated_span(ids, seed=4))
    for row, orig in zip(out, ids):
        changed = (row != orig).nonzero().flatten()
        n = len(changed)
        assert 32 <= n <= 128 and row[0] == orig[0]
        second = int(changed[0])
        assert torch.equal(changed, torch.arange(second, second + n))  # one contiguous span
        first = int(row[second]) - int(orig[0])  # the copied tokens come from one earlier span
        assert first + n <= second and torch.equal(row[second : second + n], orig[first : first + n])
    short = torch.arange(2 * 40).view(2, 40)
    assert torch.equal(with_repeated_span(short, seed=0), short)  # no room for two 32-token spans
    assert not torch.equal(with_repeated_span(torch.arange(2 * 80).view(2, 80), seed=0), torch.arange(160).view(2, 80))


def test_with_repeated_span_several_spans_are_one_span_after_another():
    """spans=k copies k spans per sequence, the i-th as one span with seed + i would: a later copy may
    overwrite an earlier one, never token 0; short spans are as asked."""
    ids = torch.arange(4 * 1024).view(4, 1024)
    out = with_repeated_span(ids, seed=5, shortest=8, longest=32, spans=4)
    step = ids
    for i in range(4):
        step = with_repeated_span(step, seed=5 + i, shortest=8, longest=32)
    assert torch.equal(out, step)
    assert torch.equal(with_repeated_span(ids, seed=5, spans=1), with_repeated_span(ids, seed=5))
    for row, orig in zip(out, ids):
        changed = int((row != orig).sum())
        assert 8 <= changed <= 4 * 32 and row[0] == orig[0]
