"""What a run leaves in output_dir (listed in train.py's docstring): the check that output_dir may be
written, the result, the logs (recipe.yaml, the CSV logs, metrics.json, curves.png) and the final
fine-tuned model."""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from ..checkpoint.files import refuse_symlinks
from ..checkpoint.finite import require_finite
from ..dtypes import torch_dtype
from .checkpoints import TrainerState
from .processes import full_state_dict
from .recipe import Recipe

# Everything a run writes into output_dir (see the module docstring).
OUTPUT_NAMES = ("recipe.yaml", "converted", "checkpoints", "model", "train_log.csv", "eval_log.csv", "metrics.json", "curves.png")


@dataclass
class FinetuneResult:
    output_dir: str
    model_dir: str | None  # None when the run stopped before the end
    completed: bool
    steps: int  # optimizer steps done (in all runs, resumed ones included)
    total_steps: int
    tokens: int  # training tokens consumed (every process, every step)
    trained_parameters: int
    total_parameters: int
    start_perplexity: float | None
    final_perplexity: float | None
    eval_tokens: int | None
    final_loss: float | None
    wall_seconds: float  # this run only
    cpu_seconds: float  # this process's CPU time (all threads), this run only
    tokens_per_second: float | None  # training tokens / wall time of the training steps, this run
    hardware: str
    resumed_from: str | None = None
    converted_dir: str | None = None
    train_sequences: int = 0  # packed training sequences available
    epochs: float = 0.0  # passes over them
    trainable_per_process: list[int] | None = None  # train.fsdp: trainable values each process holds


    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_output_dir(out: Path, force: bool) -> None:
    """output_dir must be new, empty, or an earlier run's (which resumes); other contents need
    ``force``. Nothing we write there may be a symlink (it would be written through)."""
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"output_dir {out} exists and is not a directory")
    if not out.is_dir():
        return
    refuse_symlinks(out, OUTPUT_NAMES)
    foreign = sorted(
        p.name for p in out.iterdir()
        if p.name not in OUTPUT_NAMES and not (p.name.startswith(".") and p.name[1:].split(".tmp-")[0] in OUTPUT_NAMES)
    )
    if foreign and not force:
        raise FileExistsError(
            f"output_dir {out} is not empty and not an earlier fine-tuning run (it holds {foreign[0]}); "
            "pass --force to write into it"
        )


def write_logs(recipe: Recipe, state: TrainerState, summary: dict | None = None) -> None:
    out = recipe.output_dir
    (out / "recipe.yaml").write_text(yaml.safe_dump(recipe.dump(), sort_keys=False))
    for name, rows in (("train_log.csv", state.train_log), ("eval_log.csv", state.eval_log)):
        if not rows:
            continue
        keys = list(dict.fromkeys(k for r in rows for k in r))
        with (out / name).open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=keys)
            writer.writeheader()
            writer.writerows(rows)
    payload = {"summary": summary, "train_log": state.train_log, "eval_log": state.eval_log}
    (out / "metrics.json").write_text(json.dumps(payload, indent=1, default=str))
    from ..eval.plots import plot_curves

    plot_curves(state.train_log, state.eval_log, out / "curves.png", title=recipe.notes)


def save_model(accelerator, model, recipe: Recipe, model_dir: Path, state: TrainerState) -> Path:
    from ..checkpoint.files import copy_tokenizer_files
    from ..checkpoint.writer import atomic_output_dir, usual_file_mode

    out = recipe.output_dir / "model"
    accelerator.wait_for_everyone()
    fsdp = recipe.train.fsdp
    full = full_state_dict(model, fsdp) if fsdp else None  # a collective: every process takes part
    if accelerator.is_main_process:
        net = accelerator.unwrap_model(model)
        save_dtype = torch_dtype(recipe.save_dtype or ("bf16" if recipe.train.precision == "bf16" else "fp32"))
        if recipe.train.gradient_checkpointing:
            (getattr(net, "activation_checkpointing_disable", None) or net.gradient_checkpointing_disable)()
        if fsdp:
            full = {k: v.to(save_dtype) for k, v in full.items()}
        else:
            net.to(save_dtype)
        for name, p in (full if fsdp else net.state_dict()).items():
            require_finite(p, f"fine-tuned tensor {name!r}")
        mla = dict(net.config.mla)
        mla["method"] = {**mla.get("method", {}), "finetune": {
            "steps": state.step, "tokens": state.tokens, "trainable": recipe.train.trainable,
            "data": recipe.data.train, "recipe": recipe.dump(),
        }}
        net.config.mla = mla
        net.config.use_cache = True
        with atomic_output_dir(out, force=True) as tmp:  # never through a symlink; nothing half-written
            net.save_pretrained(tmp, safe_serialization=True, state_dict=full)
            for written in tmp.glob("*.safetensors"):
                usual_file_mode(written)
            if not copy_tokenizer_files(model_dir, tmp):
                from transformers import AutoTokenizer

                AutoTokenizer.from_pretrained(model_dir).save_pretrained(tmp)
    accelerator.wait_for_everyone()
    return out


__all__ = ["OUTPUT_NAMES", "FinetuneResult", "check_output_dir", "save_model", "write_logs"]
