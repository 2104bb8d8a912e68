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
    as_json: JsonFlag = False,
) -> None:
    """Fine-tune from a recipe: one GPU, several through `accelerate launch`, or the CPU.

    Writes OUTPUT_DIR/model (native MLA, loadable like any conversion), checkpoints, loss and
    perplexity curves (CSV, JSON, PNG). Re-running resumes from the newest checkpoint.
    """
    from ..finetune.recipe import load_recipe
    from ..finetune.train import run_finetune

    spec = load_recipe(recipe, set_ or [])
    result = run_finetune(spec)
    from accelerate.state import PartialState

    if PartialState().is_main_process:
        emit(result.to_dict(), as_json, "fine-tuning")
