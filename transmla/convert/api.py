"""convert(): resolve the source, run the method, write the MLA checkpoint (or its export)."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from ..checkpoint.resolve import load_config, resolve_model_dir
from ..checkpoint.writer import parse_size, scratch_dir
from ..dtypes import pick_device, torch_dtype
from ..families import attention_geometry, family_for
from ..mla.model import is_mla_config
from .methods import get_method
from .options import ConvertOptions
from .pipeline import ConvertResult, write_mla_checkpoint

FORMATS = ("native", "deepseek")


def check_shared_rope(options: ConvertOptions, config) -> None:
    """Methods other than TransMLA keep every KV head's rope pairs; only some of their shapes share one grid."""
    g = attention_geometry(config).num_kv_heads
    if options.method == "transmla":
        return
    if options.method == "lossless" and g > 1:
        raise ValueError(
            f"--shared-rope: lossless keeps the rope pairs of all {g} KV heads (each frequency {g} times), "
            "which no shared rope grid represents; use --method transmla"
        )
    if options.method == "mha2mla" and (g > 1 or options.rope_select not in ("high", "uniform")):
        raise ValueError(
            "--shared-rope: mha2mla keeps each KV head's own rope pairs; only a single-KV-head source with "
            "--rope-select high or uniform shares one grid; use --method transmla"
        )


def refuse_overlap(source_dir: Path, output: Path) -> None:
    """The output may be neither the source folder, nor inside it, nor around it (--force would
    replace the source with its conversion)."""
    src, out = Path(os.path.realpath(source_dir)), Path(os.path.realpath(output))
    if out == src or out.is_relative_to(src) or src.is_relative_to(out):
        relation = "is" if out == src else ("is inside" if out.is_relative_to(src) else "contains")
        raise ValueError(f"output {output} {relation} the source folder {source_dir}: choose another output folder")


def check_meaningful(options: ConvertOptions) -> None:
    """Settings that would silently give no saving, or be ignored, are errors."""
    if options.kv_budget is not None and not 0 < options.kv_budget < 1:
        raise ValueError(
            f"--kv-budget is the fraction of the source's KV cache to keep, between 0 and 1 (exclusive), "
            f"got {options.kv_budget}; --method lossless keeps all of it"
        )
    if options.method == "lossless":
        given = [flag for flag, value in (
            ("--kv-budget", options.kv_budget), ("--kv-lora-rank", options.kv_lora_rank), ("--rope-dim", options.rope_dim),
            ("--rope-pairs", options.rope_pairs), ("--q-lora-rank", options.q_lora_rank),
        ) if value is not None]
        if given:
            raise ValueError(
                f"{given[0]} does not apply to --method lossless (it keeps the whole cache); "
                "use --method transmla or mha2mla to shrink the cache"
            )


def convert(source: str, output: str | Path, options: ConvertOptions, progress: bool = True) -> ConvertResult:
    if options.format not in FORMATS:
        raise ValueError(f"--format must be one of {', '.join(FORMATS)}, got {options.format!r}")
    if options.format == "deepseek":
        options = replace(options, shared_rope=True)
    if options.dtype is not None:
        torch_dtype(options.dtype)  # fail before any work on a bad name
    parse_size(options.max_shard_size)  # fail early on a bad size
    check_meaningful(options)
    pick_device(options.device)  # cuda without a GPU fails here, before any work (every method)
    method = get_method(options.method)
    output = Path(output)
    if output.exists() and not output.is_dir():
        raise FileExistsError(f"{output} exists and is not a directory")
    if output.is_dir() and any(output.iterdir()) and not options.force:
        raise FileExistsError(f"output directory {output} is not empty; pass --force to replace it")
    export_options = None
    if options.format == "deepseek":
        from ..export.deepseek import ExportOptions

        export_options = ExportOptions(dtype=options.dtype, max_shard_size=options.max_shard_size, force=options.force)
    source_dir = resolve_model_dir(source)
    refuse_overlap(source_dir, output)
    config = load_config(source_dir)
    if is_mla_config(config):
        raise ValueError(f"{source} is already an MLA model")
    family_for(config)
    if options.shared_rope:
        check_shared_rope(options, config)
    layers, meta = method(source_dir, config, options, progress)
    meta = {**meta, "source": str(source), "options": options.to_dict()}
    if export_options is None:
        return write_mla_checkpoint(
            source_dir, config, output, layers, meta,
            dtype=options.dtype, max_shard_size=options.max_shard_size, force=options.force, progress=progress,
        )
    return _convert_and_export(source_dir, config, output, layers, meta, options, export_options, progress)


def _convert_and_export(source_dir, config, output: Path, layers, meta, options, export_options, progress) -> ConvertResult:
    """--format deepseek: the native model is written beside OUTPUT, exported into OUTPUT, then removed."""
    from ..export.deepseek import export_deepseek

    output = Path(os.path.abspath(output))
    output.parent.mkdir(parents=True, exist_ok=True)
    with scratch_dir(output.parent, output.name) as native:  # locked: a killed run's is removed by the next
        result = write_mla_checkpoint(
            source_dir, config, native / "model", layers, meta,
            dtype=options.dtype, max_shard_size=options.max_shard_size, progress=progress,
        )
        exported = export_deepseek(native / "model", output, export_options, progress=progress)
    return replace(result, output=str(output), files=exported.files,
                   kv_elements_per_token_per_layer=exported.kv_elements_per_token_per_layer)
