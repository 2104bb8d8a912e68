"""convert(): resolve the source, run the method, write the MLA checkpoint (or its export)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from ..checkpoint.resolve import load_config, resolve_model_dir
from ..checkpoint.writer import scratch_dir
from ..families import attention_geometry, family_for
from ..mla.model import is_mla_config
from .layers import MLALayer
from .options import ConvertOptions
from .pipeline import ConvertResult, LayerStream, write_mla_checkpoint
from .registry import get_method

# (source folder, config, {stage: every layer at that stage}) -> what to record under "stage_perplexity"
StageReport = Callable[[Path, object, dict[str, list[MLALayer]]], dict]


def refuse_overlap(source_dir: Path, output: Path) -> None:
    """The output may be neither the source folder, nor inside it, nor around it (--force would
    replace the source with its conversion)."""
    src, out = Path(os.path.realpath(source_dir)), Path(os.path.realpath(output))
    if out == src or out.is_relative_to(src) or src.is_relative_to(out):
        relation = "is" if out == src else ("is inside" if out.is_relative_to(src) else "contains")
        raise ValueError(f"output {output} {relation} the source folder {source_dir}: choose another output folder")


def convert(source: str, output: str | Path, options: ConvertOptions, progress: bool = True,
            stage_report: StageReport | None = None) -> ConvertResult:
    """stage_report: evaluate the method's intermediate stages (eval.stages for --eval-data); its
    result is recorded in config.json. options.output.format "deepseek" converts with one shared
    rope grid (the method's shared_rope settings) and exports the result."""
    method = get_method(options.method)
    output = Path(output)
    if output.exists() and not output.is_dir():
        raise FileExistsError(f"{output} exists and is not a directory")
    if output.is_dir() and any(output.iterdir()) and not options.output.force:
        raise FileExistsError(f"output directory {output} is not empty; pass --force to replace it")
    exporting = options.output.format == "deepseek"
    if exporting:
        options.output.refuse_fp16()
    source_dir = resolve_model_dir(source)
    refuse_overlap(source_dir, output)
    config = load_config(source_dir)
    if is_mla_config(config):
        raise ValueError(f"{source} is already an MLA model")
    family_for(config)
    if exporting:
        from ..export.deepseek_plan import check_source

        check_source(config, options.output)  # before the slow part: a refused export writes nothing
        options = replace(options, settings=method.shared_rope(attention_geometry(config), options.settings))
    layers = LayerStream(method, source_dir, config, options, progress=progress, keep_stages=stage_report is not None)

    def record() -> dict:
        meta = {**layers.record(), "source": str(source), "options": options.to_dict()}
        if stage_report is not None:
            meta["stage_perplexity"] = stage_report(source_dir, config, layers.stages)
        return meta

    out = options.output
    if not exporting:
        return write_mla_checkpoint(
            source_dir, config, output, layers, record,
            dtype=out.dtype, max_shard_size=out.max_shard_size, force=out.force, progress=progress,
        )
    from ..export.deepseek import export_deepseek

    output = Path(os.path.abspath(output))
    output.parent.mkdir(parents=True, exist_ok=True)
    with scratch_dir(output.parent, output.name) as native:  # locked: a killed run's is removed by the next
        result = write_mla_checkpoint(
            source_dir, config, native / "model", layers, record,
            dtype=out.dtype, max_shard_size=out.max_shard_size, progress=progress,
        )
        exported = export_deepseek(native / "model", output, options.output, progress=progress)
    return replace(result, output=str(output), files=exported.files,
                   kv_elements_per_token_per_layer=exported.kv_elements_per_token_per_layer)
