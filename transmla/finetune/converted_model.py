"""The MLA model a run trains: model.path as it is, or model.source converted on demand into
output_dir/converted. The first process converts (or reuses a conversion with the same settings,
recorded in a marker file); the others poll that marker, since a conversion may outlast every
collective's timeout."""

from __future__ import annotations

import json
import time
from pathlib import Path

from .checkpoints import checkpoint_dirs
from .processes import log_main
from .recipe import Recipe


def converted_dir(recipe: Recipe, accelerator, progress: bool) -> tuple[Path, str | None]:
    """The MLA checkpoint to train: model.path, or model.source converted into output_dir/converted."""
    from ..checkpoint.resolve import load_config, resolve_model_dir
    from ..mla.model import is_mla_config

    spec = recipe.model
    if spec.path is not None:
        path = resolve_model_dir(spec.path)
        if not is_mla_config(load_config(path)):
            raise ValueError(
                f"model.path {spec.path} is not a converted MLA checkpoint; "
                "give model.source and model.convert to convert it first"
            )
        return path, None
    target = recipe.output_dir / "converted"
    marker = target / "transmla_convert_settings.json"
    settings = {"source": spec.source, **spec.convert.model_dump(mode="json")}
    if accelerator.is_main_process:
        reuse = marker.is_file() and json.loads(marker.read_text()) == settings
        if reuse:
            log_main(accelerator, f"[dim]reusing the conversion in {target}[/dim]")
        else:
            stale = checkpoint_dirs(recipe.output_dir / "checkpoints") if recipe.checkpoint.resume == "auto" else []
            if stale:  # they were trained from the previous conversion: resuming would mix the two
                raise ValueError(
                    f"{stale[-1]} was trained from an earlier conversion with other settings than model.convert "
                    f"now gives; remove {recipe.output_dir / 'checkpoints'} or set checkpoint.resume: never"
                )
            from ..convert.api import convert
            from ..convert.options import ConvertOptions

            log_main(accelerator, f"converting {spec.source} into {target} ({spec.convert.method})")
            options = ConvertOptions.of(**spec.convert.model_dump(exclude_none=True), force=True)
            convert(spec.source, target, options, progress=progress)
            marker.write_text(json.dumps(settings, indent=1))
    else:
        # Not a collective: a conversion (and a download) may outlast train.timeout_seconds, which
        # bounds every collective wait. If the first process dies meanwhile, the launcher ends this one.
        while not (marker.is_file() and _read_json(marker) == settings):
            time.sleep(1.0)
    accelerator.wait_for_everyone()
    return target, str(target)


def _read_json(path: Path):
    """The JSON in `path`, or None while it is being written."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


__all__ = ["converted_dir"]
