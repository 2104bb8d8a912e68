"""transmla finetune: brief fine-tuning of a converted (or to-be-converted) model from a YAML recipe."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .common import JsonFlag, emit


def finetune(
    recipe: Annotated[Path, typer.Argument(help="A YAML recipe (see recipes/).")],
    set_: list[str] = typer.Option(
        None, "--set", help="Override a recipe key: key=value, dotted for nested keys (train.steps=50). Repeatable."
    ),
    force: bool = typer.Option(False, "--force", help="Write into an output_dir that holds other files."),
    as_json: JsonFlag = False,
) -> None:
    """Fine-tune from a recipe: one GPU, several through `accelerate launch`, or the CPU.

    Writes OUTPUT_DIR/model (native MLA, loadable like any conversion), checkpoints, loss and
    perplexity curves (CSV, JSON, PNG). Re-running resumes from the newest checkpoint. OUTPUT_DIR
    must be new, empty or an earlier run's, unless --force.
    """
    from ..finetune.recipe import load_recipe
    from ..finetune.train import run_finetune

    spec = load_recipe(recipe, set_ or [])
    result = run_finetune(spec, force=force)
    from accelerate.state import PartialState

    if PartialState().is_main_process:
        emit(result.to_dict(), as_json, "fine-tuning")
