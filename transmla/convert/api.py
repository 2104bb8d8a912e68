"""convert(): resolve the source, run the method, write the MLA checkpoint."""

from __future__ import annotations

from pathlib import Path

from ..checkpoint.resolve import load_config, resolve_model_dir
from ..checkpoint.writer import parse_size
from ..dtypes import torch_dtype
from ..families import family_for
from ..mla.model import is_mla_config
from .methods import get_method
from .options import ConvertOptions
from .pipeline import ConvertResult, write_mla_checkpoint


def convert(source: str, output: str | Path, options: ConvertOptions, progress: bool = True) -> ConvertResult:
    if options.dtype is not None:
        torch_dtype(options.dtype)  # fail before any work on a bad name
    parse_size(options.max_shard_size)  # fail early on a bad size
    method = get_method(options.method)
    output = Path(output)
    if output.exists() and not output.is_dir():
        raise FileExistsError(f"{output} exists and is not a directory")
    if output.is_dir() and any(output.iterdir()) and not options.force:
        raise FileExistsError(f"output directory {output} is not empty; pass --force to replace it")
    source_dir = resolve_model_dir(source)
    config = load_config(source_dir)
    if is_mla_config(config):
        raise ValueError(f"{source} is already an MLA model")
    family_for(config)
    layers, meta = method(source_dir, config, options, progress)
    meta = {**meta, "source": str(source), "options": options.to_dict()}
    return write_mla_checkpoint(
        source_dir, config, output, layers, meta,
        dtype=options.dtype, max_shard_size=options.max_shard_size, force=options.force, progress=progress,
    )
