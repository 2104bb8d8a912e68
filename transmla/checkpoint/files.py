"""Copying the non-weight files (tokenizer, generation config) a checkpoint needs."""

from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "generation_config.json",
)
CHAT_TEMPLATE_GLOB = "chat_template*"


def tokenizer_file_names(src_dir: str | Path) -> list[str]:
    """Names of the tokenizer/generation files present in ``src_dir`` (incl. chat templates)."""
    src = Path(src_dir)
    names = [n for n in TOKENIZER_FILES if (src / n).is_file()]
    names += sorted(p.name for p in src.glob(CHAT_TEMPLATE_GLOB) if p.is_file())
    return names


def copy_tokenizer_files(src_dir: str | Path, dst_dir: str | Path) -> list[str]:
    """Copy whichever tokenizer/generation files exist from ``src_dir``; return their names."""
    src, dst = Path(src_dir), Path(dst_dir)
    if not src.is_dir():
        raise FileNotFoundError(f"source directory not found: {src}")
    dst.mkdir(parents=True, exist_ok=True)
    names = tokenizer_file_names(src)
    for name in names:
        shutil.copyfile(src / name, dst / name)  # follows symlinks (HF cache snapshots)
    return names
