"""End to end on the real built-in SmolLM2-135M: lossless conversion keeps perplexity and text."""

from __future__ import annotations

import json

import pytest
import torch

from transmla.checkpoint.builtin import builtin_gguf
from transmla.checkpoint.gguf_source import gguf_metadata
from transmla.checkpoint.resolve import cache_root, load_model, resolve_model_dir
from transmla.convert.api import convert
from transmla.convert.options import ConvertOptions
from transmla.data.texts import load_text
from transmla.eval.perplexity import perplexity, tokenize_text
from transmla.eval.kv import cache_elements
from transmla.mla.model import set_decode_mode

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lossless_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2") / "lossless"
    convert("smollm2-135m", out, ConvertOptions.of(method="lossless"), progress=False)
    return out


def test_builtin_tokenizer_matches_gguf_metadata():
    meta = gguf_metadata(builtin_gguf("smollm2-135m", cache_root()))
    _, tok = load_model("smollm2-135m")
    assert tok.bos_token_id == meta["bos_token_id"] and tok.eos_token_id == meta["eos_token_id"]
    ids = tok("Hello world").input_ids
    assert (meta.get("add_bos_token", False)) == (ids[0] == tok.bos_token_id)
    assert json.loads((resolve_model_dir("smollm2-135m") / "config.json").read_text())["num_key_value_heads"] == 3


def test_lossless_perplexity_equals_source(lossless_dir):
    source, tok = load_model("smollm2-135m")
    mla, _ = load_model(lossless_dir)
    assert mla.config.mla["kv_lora_rank"] + mla.config.mla["qk_rope_head_dim"] == 384
    ids = tokenize_text(tok, load_text("wiki", part="eval"))
    a = perplexity(source, ids, seq_len=256, max_windows=4, progress=False)
    b = perplexity(mla, ids, seq_len=256, max_windows=4, progress=False)
    assert a.tokens == b.tokens == 4 * 255
    assert abs(a.perplexity - b.perplexity) / a.perplexity < 1e-5
    assert 5 < a.perplexity < 60  # a working English model on English text


def test_lossless_generates_like_source_through_latent_cache(lossless_dir):
    source, tok = load_model("smollm2-135m")
    mla, _ = load_model(lossless_dir)
    set_decode_mode(mla, "absorbed")
    inputs = tok("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        a = source.generate(**inputs, max_new_tokens=8, do_sample=False)
        out = mla.generate(**inputs, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    assert out.sequences.tolist() == a.tolist()
    tokens = out.sequences.shape[1] - 1
    assert cache_elements(out.past_key_values) == tokens * 384 * 30
