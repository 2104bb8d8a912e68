"""Training state on disk without pickle: tensors in safetensors, everything else in JSON.

A checkpoint folder holds

    model.safetensors        every model tensor (the frozen ones too: resume needs no other file)
    optimizer.safetensors    the optimizer's per-parameter tensors, keyed "<param index>.<name>"
    optimizer.json           its param groups and any non-tensor per-parameter values
    scheduler.json           the LR scheduler's state (numbers only)
    rng-<rank>.safetensors   each process's torch CPU (and CUDA) generator states
    rng-<rank>.json          each process's Python and NumPy generator states
    trainer.json             step, tokens, logs and the recipe

Nothing here is ever unpickled, so a file planted in a checkpoint folder cannot run code: files
we do not know are ignored, and ours are parsed as data. (accelerate's save_state/load_state
pickle the optimizer, scheduler and RNG states and unpickle them with weights_only=False.)
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, load_model, save_file, save_model

MODEL_FILE = "model.safetensors"
OPTIMIZER_TENSORS = "optimizer.safetensors"
OPTIMIZER_JSON = "optimizer.json"
SCHEDULER_JSON = "scheduler.json"
TRAINER_JSON = "trainer.json"
REQUIRED = (MODEL_FILE, OPTIMIZER_TENSORS, OPTIMIZER_JSON, SCHEDULER_JSON, TRAINER_JSON)


def _rng_files(rank: int) -> tuple[str, str]:
    return f"rng-{rank}.safetensors", f"rng-{rank}.json"


def _json_value(value, what: str):
    """Plain JSON data (tuples become lists); anything else is refused rather than pickled."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_json_value(v, what) for v in value]
    if isinstance(value, dict):
        return {str(k): _json_value(v, what) for k, v in value.items()}
    raise TypeError(f"{what}: cannot store a {type(value).__name__} without pickle")


# --- optimizer -----------------------------------------------------------------------------------


def _optimizer_split(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, dict] = {}
    for index, per_param in state["state"].items():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{index}.{key}"] = value.detach().cpu().contiguous()
            else:
                values.setdefault(str(index), {})[key] = _json_value(value, f"optimizer state {key}")
    groups = [_json_value(g, "optimizer param group") for g in state["param_groups"]]
    return tensors, {"param_groups": groups, "values": values}


def _optimizer_join(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict] = {}
    for name, tensor in tensors.items():
        index, key = name.split(".", 1)
        state.setdefault(int(index), {})[key] = tensor
    for index, per_param in meta["values"].items():
        state.setdefault(int(index), {}).update(per_param)
    groups = [{**g, "betas": tuple(g["betas"])} if "betas" in g else g for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


# --- random generators ---------------------------------------------------------------------------


def _rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{i}"] = s
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return tensors, {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
    }


def _set_rng_state(tensors: dict[str, torch.Tensor], meta: dict) -> None:
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[k] for k in sorted((k for k in tensors if k.startswith("cuda.")), key=lambda k: int(k[5:]))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    version, internal, gauss = meta["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


# --- the folder ----------------------------------------------------------------------------------


def save_training_state(
    folder: Path, model: torch.nn.Module, optimizer, scheduler, trainer: dict, rank: int = 0, main: bool = True
) -> None:
    """Write the training state into ``folder`` (main process: everything; others: their RNG)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng_tensors, rng_meta = _rng_state()
    rng_st, rng_json = _rng_files(rank)
    save_file(rng_tensors, str(folder / rng_st))
    (folder / rng_json).write_text(json.dumps(rng_meta))
    if not main:
        return
    save_model(model, str(folder / MODEL_FILE))  # handles tied weights
    opt_tensors, opt_meta = _optimizer_split(optimizer)
    save_file(opt_tensors, str(folder / OPTIMIZER_TENSORS))
    (folder / OPTIMIZER_JSON).write_text(json.dumps(opt_meta))
    (folder / SCHEDULER_JSON).write_text(json.dumps(_json_value(scheduler.state_dict(), "scheduler state")))
    (folder / TRAINER_JSON).write_text(json.dumps(_json_value(trainer, "trainer state"), indent=1))


def is_training_state(folder: Path) -> bool:
    return folder.is_dir() and (folder / TRAINER_JSON).is_file()


def load_training_state(folder: Path, model: torch.nn.Module, optimizer, scheduler, rank: int = 0) -> dict:
    """Restore what :func:`save_training_state` wrote; returns the trainer dict."""
    missing = [n for n in REQUIRED if not (folder / n).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{folder} is not a checkpoint this version can resume (no {missing[0]}); "
            "checkpoints written by older versions used pickle and are not loaded"
        )
    try:
        missing_keys, unexpected = load_model(model, str(folder / MODEL_FILE), strict=False)
    except RuntimeError as e:
        raise ValueError(f"{folder / MODEL_FILE} does not fit this model: {str(e).splitlines()[0]}") from None
    if missing_keys or unexpected:
        raise ValueError(f"{folder / MODEL_FILE} does not fit this model: {(missing_keys or unexpected)[0]}")
    meta = json.loads((folder / OPTIMIZER_JSON).read_text())
    optimizer.load_state_dict(_optimizer_join(load_file(str(folder / OPTIMIZER_TENSORS)), meta))
    scheduler.load_state_dict(json.loads((folder / SCHEDULER_JSON).read_text()))
    rng_st, rng_json = _rng_files(rank)
    if (folder / rng_st).is_file() and (folder / rng_json).is_file():
        _set_rng_state(load_file(str(folder / rng_st)), json.loads((folder / rng_json).read_text()))
    return json.loads((folder / TRAINER_JSON).read_text())
