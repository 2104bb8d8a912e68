"""GGUF export checked in a real llama.cpp (built by `make llama-cpp`): a tiny random stock
DeepseekV3ForCausalLM written as a deepseek2 GGUF gives transformers' logits in llama.cpp, in
prefill and token-by-token decode, with a KV cache of d_c + d_r values per token per layer."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
import transformers

from transmla.bench.llama_cpp import kv_cache_report, llama_logits, llama_tokenize
from transmla.export.errors import ExportError
from transmla.export.gguf import write_gguf

TINY_DEEPSEEK = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=2,
    max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
# Qwen2's pre-tokenizer split (its tokenizer.json): contractions of any case, one token per digit
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
TOKENS = [5, 77, 299, 13, 42, 100, 7, 256, 1, 64, 33, 150, 200, 9, 18, 240]


def save_byte_level_tokenizer(path, vocab_size: int = 300, pre: str = "gpt-2") -> None:
    """A byte-level BPE tokenizer (GPT-2 style, as SmolLM2's) with at most `vocab_size` tokens; pre: the
    pre-tokenizer in front of it after training, as llama.cpp names them: gpt-2 (none), smollm (one token per
    digit first: the Hub's SmolLM2 tokenizer) or qwen2 (Qwen2's split regex, the byte level without its own)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["the cat sat on the mat, 12 cats sat on 345 mats."] * 50, trainer)
    # after training, so merges of digits exist and the split changes the ids
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), tok.pre_tokenizer])
    elif pre == "qwen2":
        split = pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated")
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    assert tok.get_vocab_size() <= vocab_size
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(path)


def tiny_deepseek(path, seed: int = 0, **overrides):
    """A tiny random stock DeepseekV3ForCausalLM (fp32, non-trivial norms) saved with a tokenizer."""
    config = transformers.DeepseekV3Config(**{**TINY_DEEPSEEK, **overrides})
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.08)
    model.save_pretrained(path)
    save_byte_level_tokenizer(path, config.vocab_size)
    return model


def export(path, out, weight_type="f32"):
    from safetensors.torch import load_file

    config = json.loads((path / "config.json").read_text())
    tensors = load_file(path / "model.safetensors")
    return write_gguf(config, iter(tensors.items()), path, out, weight_type)


def relative_error(ours: np.ndarray, ref: torch.Tensor) -> float:
    ref = ref.detach().numpy()
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize(
    "overrides",
    [{}, {"rope_interleave": False}, {"q_lora_rank": 24}],
    ids=["interleaved-rope", "rotate-half-rope", "q-lora"],
)
def test_llama_cpp_logits_equal_transformers(tmp_path, overrides):
    model = tiny_deepseek(tmp_path / "ds", **overrides)
    result = export(tmp_path / "ds", tmp_path / "ds.gguf")
    with torch.no_grad():
        ref = model(torch.tensor([TOKENS])).logits[0]  # [T, V]
    for mode in ("prefill", "decode"):
        logits, _ = llama_logits(result.path, TOKENS, mode)
        assert relative_error(logits, ref) <= 1e-4, mode


def test_llama_cpp_kv_cache_holds_latent_and_rope_key(tmp_path):
    tiny_deepseek(tmp_path / "ds")
    result = export(tmp_path / "ds", tmp_path / "ds.gguf")
    assert result.cache_elements == 32 + 8
    n_ctx = 65536
    _, log = llama_logits(result.path, TOKENS[:4], "prefill", n_ctx=n_ctx)
    kv = kv_cache_report(log)
    assert (kv.cells, kv.layers, kv.k_type) == (n_ctx, 2, "f32")
    assert kv.v_mib == 0  # V is a view of the latent in K
    assert kv.mib == pytest.approx(n_ctx * 2 * result.cache_elements * 4 / 2**20, abs=0.005)


@pytest.mark.parametrize("weight_type", ["bf16", "q8_0"])
def test_weight_types_keep_the_scaled_latent_rows_unquantized(tmp_path, weight_type):
    model = tiny_deepseek(tmp_path / "ds")
    result = export(tmp_path / "ds", tmp_path / f"ds-{weight_type}.gguf", weight_type)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(result.path).tensors}
    matrix = gguf.GGMLQuantizationType.BF16 if weight_type == "bf16" else gguf.GGMLQuantizationType.Q8_0
    assert types["blk.0.attn_q.weight"] == matrix
    assert types["blk.0.attn_kv_a_mqa.weight"] == gguf.GGMLQuantizationType.BF16
    assert types["blk.0.attn_kv_a_norm.weight"] == gguf.GGMLQuantizationType.F32
    assert types["blk.0.attn_k_b.weight"] == gguf.GGMLQuantizationType.BF16  # rows of 16: no Q8_0 block
    with torch.no_grad():
        ref = model(torch.tensor([TOKENS])).logits[0]
    logits, _ = llama_logits(result.path, TOKENS, "decode")
    assert relative_error(logits, ref) <= 2e-2


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [({"attention_bias": True}, "biases"), ({"first_k_dense_replace": 1}, "mixture-of-experts"),
     ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                           "original_max_position_embeddings": 128}}, "RoPE scaling")],
    ids=["bias", "moe", "yarn"],
)
def test_unrepresentable_models_are_refused_and_leave_nothing(tmp_path, overrides, reason):
    tiny_deepseek(tmp_path / "ds", **overrides)
    with pytest.raises(ExportError, match=reason):
        export(tmp_path / "ds", tmp_path / "ds.gguf")
    assert list(tmp_path.glob("ds.gguf*")) == []


@pytest.mark.parametrize("pre", ["gpt-2", "smollm", "qwen2"])
def test_llama_cpp_tokenizes_like_the_tokenizer_folder(tmp_path, pre):
    tiny_deepseek(tmp_path / "ds")
    save_byte_level_tokenizer(tmp_path / "ds", pre=pre)
    result = export(tmp_path / "ds", tmp_path / "ds.gguf")
    assert result.tokenizer_pre == pre
    text = "The cat sat on 12345 mats.\n  Then it's  gone!  Ünïcode 3.14 -- 'RE you 2 sure?\t\t ok"
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "ds")
    ids = hf(text)["input_ids"]
    assert llama_tokenize(result.path, text) == ids


def test_unknown_pre_tokenizer_is_refused_unless_named(tmp_path):
    tiny_deepseek(tmp_path / "ds")
    tokenizer = json.loads((tmp_path / "ds" / "tokenizer.json").read_text())
    tokenizer["pre_tokenizer"] = {"type": "Whitespace"}
    (tmp_path / "ds" / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ExportError, match="--tokenizer-pre"):
        export(tmp_path / "ds", tmp_path / "ds.gguf")
    assert not (tmp_path / "ds.gguf").exists()


# ---------------------------------------------------------------------------------------------
# Our converted models: native MLA folder -> DeepSeek tensors -> GGUF, run in llama.cpp
# ---------------------------------------------------------------------------------------------

NATIVE_CASES = {  # name -> (family, source overrides, conversion options)
    "llama-transmla-50": ("llama", {}, dict(method="transmla", kv_budget=0.5, shared_rope=True)),
    "llama-transmla-25": ("llama", {}, dict(method="transmla", kv_budget=0.25, shared_rope=True)),
    "mistral-transmla-25-qlora": ("mistral", {}, dict(method="transmla", kv_budget=0.25, shared_rope=True, q_lora_rank=16)),
    "llama-mqa-mha2mla": ("llama", {"num_key_value_heads": 1}, dict(method="mha2mla", rope_pairs=2, kv_lora_rank=6, rope_select="uniform")),
    "llama-tied-transmla-25": ("llama", {"tie_word_embeddings": True}, dict(method="transmla", kv_budget=0.25, shared_rope=True)),
}


def converted(tmp_path, family, source_overrides, options, seed=0):
    """A tiny source (byte-level BPE vocabulary) converted by the production code, on disk."""
    from conftest import make_tiny_model
    from test_export_deepseek import _convert

    src = tmp_path / "src"
    make_tiny_model(family, src, seed=seed, vocab_size=300, **source_overrides)
    native = _convert(src, tmp_path / "mla", **options)
    save_byte_level_tokenizer(native)
    return native


@pytest.mark.parametrize("case", list(NATIVE_CASES))
def test_llama_cpp_runs_our_conversions_exactly(tmp_path, case):
    from transmla.export.gguf import export_gguf

    family, source_overrides, options = NATIVE_CASES[case]
    native = converted(tmp_path, family, source_overrides, options)
    result = export_gguf(native, tmp_path / "mla.gguf", progress=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(native, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([TOKENS])).logits[0]  # [T, V]
    for mode in ("prefill", "decode"):
        logits, log = llama_logits(result.path, TOKENS, mode, n_ctx=4096)
        assert relative_error(logits, ref) <= 1e-4, mode
    kv = kv_cache_report(log)
    assert kv.v_mib == 0
    assert kv.mib == pytest.approx(4096 * kv.layers * result.cache_elements * 4 / 2**20, abs=0.005)
    assert result.cache_elements == model.config.mla["kv_lora_rank"] + model.config.mla["qk_rope_head_dim"]


def test_all_rope_keys_are_refused(tmp_path):
    from transmla.export.gguf import export_gguf

    native = converted(tmp_path, "llama", {"num_key_value_heads": 1}, dict(method="lossless"))
    with pytest.raises(ExportError, match="qk_nope_head_dim 0"):
        export_gguf(native, tmp_path / "mla.gguf", progress=False)
    assert list(tmp_path.glob("mla.gguf*")) == []


def test_biases_are_refused_unless_dropped(tmp_path):
    from transmla.export.gguf import export_gguf

    native = converted(tmp_path, "qwen2", {"bias": True}, dict(method="transmla", kv_budget=0.5, shared_rope=True))
    with pytest.raises(ExportError, match="biases"):
        export_gguf(native, tmp_path / "mla.gguf", progress=False)
    assert list(tmp_path.glob("mla.gguf*")) == []
    result = export_gguf(native, tmp_path / "mla.gguf", drop_biases=True, progress=False)
    logits, _ = llama_logits(result.path, TOKENS, "decode")
    assert np.isfinite(logits).all()


def test_cli_export_gguf(cli, tmp_path):
    native = converted(tmp_path, "llama", {}, dict(method="transmla", kv_budget=0.25, shared_rope=True))
    out_path = tmp_path / "m.gguf"
    code, out, _ = cli("export", native, out_path, "--format", "gguf", "--type", "q8_0", "--json")
    assert code == 0
    info = json.loads(out)
    assert info["type"] == "q8_0" and info["tokenizer_pre"] == "gpt-2" and info["output"] == str(out_path)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(out_path).tensors}
    assert types["blk.0.ffn_down.weight"] == gguf.GGMLQuantizationType.Q8_0  # rows of 64 (48 falls back to bf16)
    code, out, err = cli("export", native, out_path, "--format", "gguf")
    assert code == 1 and err.startswith("error: ") and len(err.strip().splitlines()) == 1 and "exists" in err


def test_mixtral_is_refused_with_the_reason(tmp_path):
    from transmla.export.gguf import export_gguf

    native = converted(tmp_path, "mixtral", {}, dict(method="transmla", kv_budget=0.5, shared_rope=True))
    with pytest.raises(ExportError, match="mixture-of-experts"):
        export_gguf(native, tmp_path / "mla.gguf", progress=False)
    assert list(tmp_path.glob("mla.gguf*")) == []
