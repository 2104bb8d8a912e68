"""Checkpoints of a run: what the trainer state holds, writing one (all-or-nothing, the newest
`checkpoint.keep` kept), which to resume from, and the checks that a resume continues the same run
(the same sequences per step, the same starting model by its fingerprint)."""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .recipe import Recipe
from .state import is_training_state, save_training_state

CHECKPOINT_PREFIX = "step-"


@dataclass
class TrainerState:
    """What a checkpoint holds besides model/optimizer/schedule/RNG: position and history."""

    step: int = 0
    tokens: int = 0
    processes: int = 1
    sequences_per_step: int = 0  # processes x micro_batch_size x grad_accum (0: not recorded)
    start_model: str = ""  # sha256 of the starting model's config.json ("": not recorded)
    train_log: list[dict] = field(default_factory=list)
    eval_log: list[dict] = field(default_factory=list)

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key in self.__dataclass_fields__:
            if key in state:
                setattr(self, key, state[key])


def checkpoint_dirs(root: Path) -> list[Path]:
    found = [p for p in root.glob(f"{CHECKPOINT_PREFIX}*") if is_training_state(p)]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX):]))


def resume_dir(recipe: Recipe) -> Path | None:
    mode = recipe.checkpoint.resume
    if mode == "never":
        return None
    if mode == "auto":
        found = checkpoint_dirs(recipe.output_dir / "checkpoints")
        return found[-1] if found else None
    path = Path(mode).expanduser()
    if not is_training_state(path):
        raise FileNotFoundError(f"checkpoint.resume: {path} is not a checkpoint folder (no trainer.json)")
    return path


def save_checkpoint(accelerator, recipe: Recipe, state: TrainerState, model, optimizer, scheduler) -> Path:
    if recipe.train.fsdp:
        raise ValueError("train.fsdp: checkpoints of sharded training state are not written yet; a run with "
                         "train.fsdp must run to its end in one go (set checkpoint.every: 0)")
    root = recipe.output_dir / "checkpoints"
    final = root / f"{CHECKPOINT_PREFIX}{state.step:06d}"
    tmp = root / f".{final.name}.tmp"
    if accelerator.is_main_process:
        if tmp.is_symlink() or final.is_symlink():
            raise ValueError(f"{tmp if tmp.is_symlink() else final} is a symlink: refusing to write through it")
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    trainer = {**state.state_dict(), "recipe": recipe.dump()}
    save_training_state(
        tmp, accelerator.unwrap_model(model), optimizer, scheduler, trainer,
        rank=accelerator.process_index, main=accelerator.is_main_process,
    )
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in checkpoint_dirs(root)[: -recipe.checkpoint.keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def check_resume_layout(resume: Path, state: TrainerState, world: int, micro: int, accum: int) -> None:
    """A run resumes on another number of processes only with the same sequences per step: the
    data order and the schedule are functions of (step, sequences per step)."""
    before = state.sequences_per_step
    now = micro * accum * world
    if before and before != now:
        hint = (f"; with {world} process{'es' if world > 1 else ''} set train.grad_accum to {before // (micro * world)}"
                if before % (micro * world) == 0 else "")
        raise ValueError(
            f"{resume} was written by {state.processes} process{'es' if state.processes > 1 else ''} taking {before} "
            f"sequences per step; this run takes {now} ({world} x micro_batch_size {micro} x grad_accum {accum}): "
            f"resuming needs the same sequences per step{hint}"
        )


def start_model_fingerprint(model_dir: Path) -> str:
    """What identifies the model a run starts from: the sha256 of its config.json, which records how
    it was converted (method, calibration, fit) and changes with every conversion."""
    import hashlib

    return hashlib.sha256((Path(model_dir) / "config.json").read_bytes()).hexdigest()


def check_resume_model(resume: Path, state: TrainerState, fingerprint: str, model_dir: Path, output_dir: Path) -> None:
    """A checkpoint continues only the run that started from the same model: after a new conversion
    (other convert settings, or other defaults) or another model.path its weights belong elsewhere."""
    if state.start_model and state.start_model != fingerprint:
        raise ValueError(
            f"{resume} continues a run that started from another model than {model_dir} (its config.json "
            f"differs: converted again or replaced); remove {output_dir / 'checkpoints'} or set "
            "checkpoint.resume: never to train from the new start"
        )


__all__ = ["CHECKPOINT_PREFIX", "TrainerState", "check_resume_layout", "check_resume_model", "checkpoint_dirs",
           "resume_dir", "save_checkpoint", "start_model_fingerprint"]
