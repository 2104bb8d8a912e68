"""benchmarks/recall_parts: the mixed attention computes what the layers compute, and pairs heads by index."""

import torch

from tests.conftest import make_tiny_model, save_word_tokenizer
from transmla.convert.api import convert
from transmla.convert.options import ConvertOptions


def _mixed_logits(source, converted, mix, ids):
    from benchmarks.recall_parts import mixed

    with mixed(source, converted, mix) as model:
        return model(ids, use_cache=False).logits


def test_mixes_equal_the_models_and_a_lossless_conversion_everywhere(tmp_path):
    from benchmarks.recall_parts import MIXES
    from transmla.checkpoint.resolve import load_model

    src = tmp_path / "src"
    make_tiny_model("llama", src)
    save_word_tokenizer(src)
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"w{(i * 7) % 96}" for i in range(6000)))
    convert(str(src), tmp_path / "lossless", ConvertOptions.of(method="lossless"), progress=False)
    convert(str(src), tmp_path / "lossy", ConvertOptions.of(method="transmla", kv_budget=0.5, fit_steps=0, calib=str(text),
                                                             calib_samples=8, calib_seq_len=16), progress=False)
    source, _ = load_model(str(src))
    ids = torch.randint(0, source.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = source(ids, use_cache=False).logits
        lossless, _ = load_model(str(tmp_path / "lossless"))
        for mix in MIXES:  # exact scores and exact values: every mix is the source (heads pair up by index)
            torch.testing.assert_close(_mixed_logits(source, lossless, mix, ids), want, rtol=1e-4, atol=1e-4)
        lossy, _ = load_model(str(tmp_path / "lossy"))
        torch.testing.assert_close(_mixed_logits(source, lossy, "source", ids), want, rtol=1e-5, atol=1e-5)
        whole = lossy(ids, use_cache=False).logits
        torch.testing.assert_close(_mixed_logits(source, lossy, "conversion", ids), whole, rtol=1e-4, atol=1e-4)
        for mix in ("conversion's scores", "source's scores"):  # each half of the lossy attention: neither model
            got = _mixed_logits(source, lossy, mix, ids)
            assert (got - want).abs().max() > 1e-3 and (got - whole).abs().max() > 1e-3


def test_paired_difference_and_its_standard_error():
    """paired(a, b): mean of b - a over the same items and sd / sqrt(n); items must pair up."""
    import pytest

    from benchmarks.recall_parts import paired

    mean, se = paired([1.0, 2.0, 3.0, 4.0], [2.0, 2.0, 5.0, 4.0])  # d = 1, 0, 2, 0
    assert mean == pytest.approx(0.75)
    assert se == pytest.approx((2.75 / 3) ** 0.5 / 2)
    with pytest.raises(ValueError):
        paired([1.0, 2.0], [1.0])
