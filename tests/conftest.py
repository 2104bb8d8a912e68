"""Tiny random source models of every family, saved as real checkpoints on disk."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import transformers

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSMLA_CACHE", str(Path(__file__).resolve().parent.parent / ".cache" / "transmla"))

@pytest.fixture(autouse=True)
def fp32_kernels_everywhere(monkeypatch):
    """In tests the fp32 C kernels take their calls on every CPU (the product takes them on AVX-512 and AVX2
    CPUs only, cpu_build.fp32_kernels_run), so they are checked wherever the tests run; test_cpu_decode_kernel's
    test_fp32_kernels_only_on_measured_vector_units checks the product's choice."""
    from transmla.mla.kernels import cpu_build

    monkeypatch.setattr(cpu_build, "fp32_kernels_run", lambda: True)


TINY = dict(
    vocab_size=97, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=6, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
    tie_word_embeddings=False,
)
# Per family, what the tiny models set beyond TINY (the class names come from transmla.families).
FAMILY_EXTRAS = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "gemma3_text": {},
    "mistral": {"sliding_window": None},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
}


def make_tiny_model(family: str, path: Path | None = None, seed: int = 0, bias: bool = False, **overrides):
    """A tiny random model (fp32); saved to `path` when given. Biases are made non-zero."""
    from transmla.families import FAMILIES

    spec = FAMILIES[family]
    kwargs = {**TINY, **FAMILY_EXTRAS[family], **overrides}
    if family in ("llama", "qwen3", "gemma3_text") and bias:
        kwargs["attention_bias"] = True
    config = getattr(transformers, spec.config_class)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, spec.causal_lm_class)(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)  # non-zero biases, so the tests see them
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    if path is not None:
        model.save_pretrained(path)
    return model


def random_ids(seed=0, batch=2, length=24, vocab=97) -> torch.Tensor:
    """Token ids [batch, length] below `vocab` (the tiny models' vocabulary), seeded."""
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def assert_logits_close(got, want, rel=1e-5):
    """Equal to `rel` relative to the logits' scale (fp32)."""
    torch.testing.assert_close(got, want, atol=rel * float(want.abs().max()), rtol=rel)


def perplexity(model, ids) -> float:
    """exp(mean next-token NLL) of `model` on ids [B, T]."""
    import math

    import torch.nn.functional as F

    with torch.no_grad():
        logits = model(ids).logits[:, :-1]
    return math.exp(float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))))


def assert_kernel_decode_equals_source(model, source, ids, prompt: int, steps: int) -> None:
    """Greedy decode of ids[:, :prompt] for `steps` tokens through the MLA model's latent cache: the
    absorbed decode runs in the CPU C kernel and every step's logits equal the source's (fp32, 1e-5)."""
    from transmla.mla.kernels import cpu_decode

    calls, original = [], cpu_decode.KERNEL.load

    def counted(*shape):  # (dtype, rows, width, d_c)
        calls.append(shape)
        return original(*shape)

    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_decode.KERNEL, "load", counted)
        gen = model.generate(ids[:, :prompt], max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
        ref = source(gen.sequences).logits
    assert calls and original(*calls[0]) is not None  # the absorbed decode ran in the C kernel
    for step, logits in enumerate(gen.logits):
        assert_logits_close(logits, ref[:, prompt - 1 + step])


def word_level_tokenizer(vocab: list[str], path: Path | None = None, digits: bool = False, decoder: str = "wordpiece"):
    """A word-level tokenizer over `vocab` (which must hold "[UNK]"): words split at whitespace and
    punctuation, digits one by one when `digits`; decoder "fuse" joins tokens without spaces,
    "wordpiece" with spaces but none before punctuation. Saved to `path` when given."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    split = [pre_tokenizers.Whitespace()] + ([pre_tokenizers.Digits(individual_digits=True)] if digits else [])
    tok.pre_tokenizer = pre_tokenizers.Sequence(split)
    tok.decoder = decoders.Fuse() if decoder == "fuse" else decoders.WordPiece()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    if path is not None:
        fast.save_pretrained(path)
    return fast


def save_word_tokenizer(path: Path) -> None:
    """A word-level tokenizer over w0..w95 (the tiny models' vocabulary is 97), for tests that load
    a model folder through the tokenizer as well."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(96)} | {"[UNK]": 96}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)


@pytest.fixture
def tiny_factory(tmp_path):
    def factory(family="llama", name=None, **kw):
        path = tmp_path / (name or f"{family}-src")
        model = make_tiny_model(family, path, **kw)
        return model, path

    return factory


@pytest.fixture
def cli(capsys):
    """Run the CLI in this process and capture (exit code, stdout, stderr)."""
    from transmla.cli.app import main

    def invoke(*args):
        capsys.readouterr()
        code = main([str(a) for a in args])
        out = capsys.readouterr()
        return code, out.out, out.err

    return invoke
