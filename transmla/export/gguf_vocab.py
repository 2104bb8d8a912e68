"""A Hugging Face tokenizer folder as GGUF vocabulary metadata (llama.cpp's "gpt2" BPE model).

llama.cpp re-implements each BPE pre-tokenizer in C++ and picks one by the name stored in
`tokenizer.ggml.pre`; its own converter finds that name by hashing the token ids of a probe text.
We read the pre-tokenizer straight from tokenizer.json instead and map the structures we have
checked against llama.cpp's tokenization (tests/test_export_gguf.py runs llama-tokenize on real
text) to their names; any other structure is refused unless the caller names it.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf

from .errors import ExportError

_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
# Qwen2 (and Qwen2.5): its own split, then the byte level without GPT-2's regex
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")
# llama.cpp's tokenizer.ggml.pre name -> the tokenizer.json pre_tokenizer steps it implements.
LLAMA_CPP_PRE_TOKENIZERS: dict[str, list[dict]] = {
    "gpt-2": [_BYTE_LEVEL],
    "smollm": [{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL],
    "qwen2": [{"type": "Split", "pattern": {"Regex": _QWEN2_SPLIT}, "behavior": "Isolated", "invert": False},
              {**_BYTE_LEVEL, "use_regex": False}],
}
_IRRELEVANT_KEYS = ("trim_offsets",)  # changes offsets only, never the ids


def pre_tokenizer_steps(tokenizer: dict) -> list[dict]:
    """The pre_tokenizer of a tokenizer.json as a flat list of steps (keys that cannot change ids dropped)."""
    pre = tokenizer.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    return [{k: v for k, v in step.items() if k not in _IRRELEVANT_KEYS} for step in steps]


def llama_cpp_pre_tokenizer(tokenizer: dict) -> str:
    """llama.cpp's name for this tokenizer.json's pre-tokenizer; ExportError if we know none."""
    model = tokenizer.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise ExportError(f"GGUF export supports byte-level BPE tokenizers only, not {model.get('type')!r}")
    if tokenizer.get("normalizer") is not None:
        raise ExportError("GGUF export: tokenizers with a normalizer are not supported (llama.cpp's BPE has none)")
    steps = pre_tokenizer_steps(tokenizer)
    for name, expected in LLAMA_CPP_PRE_TOKENIZERS.items():
        if steps == expected:
            return name
    raise ExportError(
        f"GGUF export: no known llama.cpp pre-tokenizer for {json.dumps(steps)}; "
        "name one with --tokenizer-pre (llama.cpp's tokenizer.ggml.pre)"
    )


def add_vocab(writer: gguf.GGUFWriter, tokenizer_dir: str | Path, vocab_size: int, pre: str | None = None) -> str:
    """Write tokens, types, merges, special ids, add-BOS/EOS and chat template; return the pre name."""
    tokenizer_dir = Path(tokenizer_dir)
    path = tokenizer_dir / "tokenizer.json"
    if not path.is_file():
        raise ExportError(f"GGUF export needs a tokenizer.json in {tokenizer_dir}")
    tokenizer = json.loads(path.read_text(encoding="utf-8"))
    pre = pre or llama_cpp_pre_tokenizer(tokenizer)

    tokens = {i: tok for tok, i in tokenizer["model"]["vocab"].items()}
    types = {i: gguf.TokenType.NORMAL for i in tokens}
    for added in tokenizer.get("added_tokens", []):
        tokens[added["id"]] = added["content"]
        types[added["id"]] = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
    if max(tokens) >= vocab_size:
        raise ExportError(f"the tokenizer has token id {max(tokens)} but the model's vocabulary is {vocab_size}")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list([tokens.get(i, f"[PAD{i}]") for i in range(vocab_size)])
    writer.add_token_types([types.get(i, gguf.TokenType.UNUSED) for i in range(vocab_size)])

    special = gguf.SpecialVocab(tokenizer_dir, load_merges=True)
    # What transformers does when the folder says nothing: no BOS/EOS added (llama.cpp's default
    # for BPE would add a BOS and shift every position).
    for kind in ("bos", "eos"):
        special.add_special_token.setdefault(kind, False)
    special.add_to_gguf(writer, quiet=True)
    return pre
