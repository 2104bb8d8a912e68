"""Turn a model argument into a local Hugging Face folder, and load models from it.

A model argument is one of: a local Hugging Face folder, a .gguf file, a built-in name
(`smollm2-135m`, `qwen2.5-coder-1.5b`, `gemma3-270m`: builtin.py), or a hub id (fetched with huggingface_hub
where a hub is reachable). GGUF files are dequantized once, one tensor at a time, and cached as a
Hugging Face folder (fp32 safetensors: gguf_source.py).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from .builtin import BUILTIN_MODELS, ModelNotFoundError, builtin_gguf
from .files import TOKENIZER_FILES
from .gguf_source import gguf_to_hf


def cache_root() -> Path:
    """Where converted GGUF and hub downloads are kept: $TRANSMLA_CACHE or ~/.cache/transmla."""
    return Path(os.environ.get("TRANSMLA_CACHE", Path.home() / ".cache" / "transmla"))


def _looks_like_path(spec: str) -> bool:
    return spec.startswith((".", "/", "~")) or spec.endswith(".gguf") or os.sep in spec.strip("/").split("/", 1)[-1]


def _from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - huggingface_hub ships with transformers
        raise ModelNotFoundError(f"{repo_id!r} is not a local path and huggingface_hub is missing") from e
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "5")
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "10")
    try:
        path = snapshot_download(
            repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.jinja"]
        )
    except Exception as e:  # network, auth, missing repo: one clear line
        reason = type(e).__name__
        raise ModelNotFoundError(
            f"{repo_id!r} is not a local folder or file, and the Hugging Face Hub could not provide it "
            f"({reason}). Offline, use a local folder, a .gguf file, or a built-in model ('smollm2-135m', 'qwen2.5-coder-1.5b')."
        ) from None
    return Path(path)


def resolve_model_dir(spec: str | Path) -> Path:
    """A local Hugging Face folder (config.json + safetensors) for any model argument."""
    spec = str(spec)
    if spec in BUILTIN_MODELS:
        return gguf_to_hf(builtin_gguf(spec, cache_root()), cache_root() / spec)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} has no config.json: not a Hugging Face model folder")
        return path
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFoundError(f"{path} is a file but not a .gguf model")
        digest = hashlib.sha1(f"{path.resolve()}:{path.stat().st_size}".encode()).hexdigest()[:12]
        return gguf_to_hf(path, cache_root() / "gguf" / f"{path.stem}-{digest}")
    if _looks_like_path(spec) or spec.count("/") > 1:
        raise ModelNotFoundError(f"no such file or directory: {spec}")
    return _from_hub(spec)


def load_config(spec: str | Path):
    from transformers import AutoConfig

    from ..mla.model import register

    register()
    return AutoConfig.from_pretrained(resolve_model_dir(spec))


def load_lm(spec: str | Path, dtype: torch.dtype | None = torch.float32, device: str = "cpu", **overrides):
    """The causal LM alone (no tokenizer needed) for a source or converted model, in eval mode;
    `overrides` replace config fields (e.g. rms_norm_eps=1e-6, as a DeepSeek export runs)."""
    from transformers import AutoModelForCausalLM

    from ..families import family_for
    from ..mla.model import register, source_model_type

    register()
    path = resolve_model_dir(spec)
    config = load_config(path)
    family_for(source_model_type(config))  # unsupported architectures fail here, clearly
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa", **overrides)
    except RuntimeError as exc:  # transformers' "look at the above report": name the tensor instead
        if "mismatched_sizes" not in str(exc):
            raise
        from .shapes import describe_shape_mismatch

        raise ValueError(describe_shape_mismatch(path, config)) from None
    return model.to(device).eval()


def load_model(spec: str | Path, dtype: torch.dtype | None = torch.float32, device: str = "cpu"):
    """(model, tokenizer) for a source or converted model, in eval mode."""
    from transformers import AutoTokenizer

    path = resolve_model_dir(spec)
    return load_lm(path, dtype, device), AutoTokenizer.from_pretrained(path)


__all__ = ["BUILTIN_MODELS", "ModelNotFoundError", "TOKENIZER_FILES", "load_config", "load_lm", "load_model", "resolve_model_dir"]
