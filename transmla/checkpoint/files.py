"""The files of a checkpoint folder by name, and copying the non-weight ones (tokenizer, generation config)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path

SINGLE_FILE = "model.safetensors"  # an unsharded checkpoint
INDEX_FILE = "model.safetensors.index.json"  # a sharded one: tensor name -> shard
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


def _link_root(folder: Path) -> Path:
    """Where a file's symlink may point: the folder itself, or for a Hugging Face cache snapshot
    (models--ORG--NAME/snapshots/REV, whose files link to ../../blobs) the repository's folder."""
    real = folder.resolve()
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        return real.parent.parent
    return real


def inside_folder(folder: str | Path, name: str) -> Path:
    """``folder / name`` if it stays within ``folder`` once symlinks are followed; a symlink that
    leads elsewhere is refused (a planted link would copy an unrelated file into the output)."""
    folder = Path(folder)
    path = folder / name
    real = path.resolve()
    if not real.is_relative_to(_link_root(folder)):
        raise ValueError(f"{path} is a symlink to {real}, outside {folder}: refusing to read it")
    return path


def refuse_symlinks(folder: str | Path, names: Iterable[str] | None = None) -> None:
    """Refuse to write into ``folder`` when one of ``names`` (default: any entry) is a symlink:
    writing through it would change a file outside the folder."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    paths = [folder / n for n in names] if names is not None else sorted(folder.iterdir())
    linked = next((p for p in paths if p.is_symlink()), None)
    if linked is not None:
        raise ValueError(f"{linked} is a symlink: refusing to write through it")


def copy_tokenizer_files(src_dir: str | Path, dst_dir: str | Path) -> list[str]:
    """Copy whichever tokenizer/generation files exist from ``src_dir``; return their names."""
    src, dst = Path(src_dir), Path(dst_dir)
    if not src.is_dir():
        raise FileNotFoundError(f"source directory not found: {src}")
    dst.mkdir(parents=True, exist_ok=True)
    names = tokenizer_file_names(src)
    refuse_symlinks(dst, names)
    for name in names:
        target = dst / name
        source = inside_folder(src, name)  # links within the folder (HF cache snapshots) are followed
        if name.endswith(".json"):
            try:
                json.loads(source.read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError) as e:
                raise ValueError(f"{source} is not valid JSON ({e}): the source's tokenizer files are damaged") from None
        shutil.copyfile(source, target)
    return names
