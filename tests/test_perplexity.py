"""Perplexity protocols on a tiny random Llama, checked against a by-hand computation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from transmla.eval.perplexity import PerplexityResult, perplexity, tokenize_text

SEQ = 16


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(cfg).float().eval()


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 64, (5 * SEQ + 7,), generator=g)  # [87]: 5 full windows + tail


def _by_hand(model, ids: torch.Tensor, seq_len: int, n_windows: int, first: int = 1) -> tuple[float, int]:
    """exp(mean NLL) over non-overlapping windows (positions first.. of each scored), one window
    and one token at a time."""
    total, count = 0.0, 0
    with torch.no_grad():
        for w in range(n_windows):
            x = ids[w * seq_len : (w + 1) * seq_len]  # [L]
            logits = model(input_ids=x[None], use_cache=False).logits[0]  # [L, V]
            for t in range(first, seq_len):
                logp = F.log_softmax(logits[t - 1].float(), dim=-1)  # [V]
                total -= float(logp[x[t]])
                count += 1
    return math.exp(total / count), count


def test_matches_hand_computation(model, ids):
    ref, count = _by_hand(model, ids, SEQ, 3)
    r = perplexity(model, ids, seq_len=SEQ, max_windows=3, batch_size=2, progress=False)
    assert isinstance(r, PerplexityResult)
    assert r.protocol == "non-overlapping" and r.stride is None
    assert r.windows == 3 and r.tokens == count == 3 * (SEQ - 1)
    assert r.perplexity == pytest.approx(ref, rel=1e-5)
    assert r.nll == pytest.approx(math.log(ref), rel=1e-5)
    assert set(r.to_dict()) == {
        "perplexity", "nll", "tokens", "windows", "seq_len", "stride", "protocol"
    }


def test_all_full_windows_and_batch_independent(model, ids):
    a = perplexity(model, ids, seq_len=SEQ, batch_size=1, progress=False)
    b = perplexity(model, ids, seq_len=SEQ, batch_size=4, progress=True)
    assert a.windows == b.windows == 5  # the 7-token tail is not a full window
    assert a.tokens == 5 * (SEQ - 1)
    assert a.perplexity == pytest.approx(b.perplexity, rel=1e-5)
    ref, _ = _by_hand(model, ids, SEQ, 5)
    assert a.perplexity == pytest.approx(ref, rel=1e-5)


def test_second_half_of_each_window_as_llama_cpp_scores(model, ids):
    first = SEQ // 2 + 1
    r = perplexity(model, ids, seq_len=SEQ, max_windows=3, progress=False, first_scored=first)
    ref, count = _by_hand(model, ids, SEQ, 3, first)
    assert r.tokens == count == 3 * (SEQ - first)
    assert r.perplexity == pytest.approx(ref, rel=1e-5)
    with pytest.raises(ValueError, match="first_scored"):
        perplexity(model, ids, seq_len=SEQ, stride=4, first_scored=first, progress=False)


def test_stride_equal_seq_len_is_non_overlapping(model, ids):
    a = perplexity(model, ids, seq_len=SEQ, max_windows=4, progress=False)
    b = perplexity(model, ids, seq_len=SEQ, max_windows=4, stride=SEQ, progress=False)
    assert b.protocol == "sliding" and b.stride == SEQ
    assert (a.perplexity, a.nll, a.tokens, a.windows) == (b.perplexity, b.nll, b.tokens, b.windows)


def _sliding_by_hand(model, ids: torch.Tensor, seq_len: int, stride: int, span: int):
    """The HF guide's loop with -100 masking, loss computed by hand."""
    total, count, prev_end = 0.0, 0, 0
    with torch.no_grad():
        for begin in range(0, span, stride):
            end = min(begin + seq_len, span)
            trg_len = end - prev_end
            x = ids[begin:end]  # [T]
            labels = x.clone()
            labels[:-trg_len] = -100
            logits = model(input_ids=x[None], use_cache=False).logits[0]  # [T, V]
            for t in range(1, x.numel()):
                if labels[t] != -100:
                    total -= float(F.log_softmax(logits[t - 1].float(), -1)[x[t]])
                    count += 1
            prev_end = end
            if end == span:
                break
    return math.exp(total / count), count


@pytest.mark.parametrize("stride", [4, 6, 8])
def test_sliding_smaller_stride(model, ids, stride):
    nonov = perplexity(model, ids, seq_len=SEQ, max_windows=4, progress=False)
    r = perplexity(model, ids, seq_len=SEQ, max_windows=4, stride=stride, progress=False)
    span = 4 * SEQ
    assert r.tokens == span - 1  # every token of the span but the very first
    assert math.isfinite(r.perplexity) and r.perplexity != nonov.perplexity
    ref, count = _sliding_by_hand(model, ids, SEQ, stride, span)
    assert r.tokens == count
    assert r.perplexity == pytest.approx(ref, rel=1e-5)


def test_text_too_short(model):
    with pytest.raises(ValueError, match="too short"):
        perplexity(model, torch.arange(SEQ - 1), seq_len=SEQ, progress=False)


def test_bad_arguments(model, ids):
    with pytest.raises(ValueError):
        perplexity(model, ids, seq_len=SEQ, stride=SEQ + 1, progress=False)
    with pytest.raises(ValueError):
        perplexity(model, ids, seq_len=SEQ, max_windows=0, progress=False)


def test_tokenize_text_no_special_tokens():
    class Tok:
        def __call__(self, text, add_special_tokens=True, verbose=True):
            assert add_special_tokens is False and verbose is False
            return {"input_ids": [ord(c) for c in text]}

    ids = tokenize_text(Tok(), "abc")
    assert ids.dtype == torch.long and ids.tolist() == [97, 98, 99]
