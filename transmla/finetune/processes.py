"""What the processes of a run share: messages from the first one, sums over all of them, the
hardware line, and train.fsdp's sharding (FSDP2) with the whole model gathered back from it."""

from __future__ import annotations

import os
import platform

import torch

from ..progress import stderr_console


def log_main(accelerator, message: str) -> None:
    if accelerator.is_main_process:
        stderr_console.print(message, highlight=False)


def hardware(accelerator) -> str:
    device = accelerator.device
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return f"{accelerator.num_processes} x {name}, torch {torch.__version__}"
    threads = torch.get_num_threads()
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {threads} threads), torch {torch.__version__}"


def sum_over_processes(accelerator, value: float) -> float:
    """`value` summed over all processes (itself with one), as float64."""
    if accelerator.num_processes == 1:
        return value
    total = accelerator.reduce(torch.tensor([value], dtype=torch.float64, device=accelerator.device), reduction="sum")
    return total.item() if isinstance(value, float) else int(total.item())


def shard_model(model, accelerator) -> list[int]:
    """train.fsdp: each decoder layer, then the rest, sharded over the processes (FSDP2: every
    parameter split along dim 0, gathered for its layer's forward and backward, gradients
    reduce-scattered and averaged as DDP averages them). Returns the trainable values each process
    holds (about trainable / processes each)."""
    from torch.distributed.fsdp import fully_shard

    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError("train.fsdp: the model has no model.layers to shard")
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    local = sum(p.to_local().numel() for p in model.parameters() if p.requires_grad)
    held = accelerator.gather(torch.tensor([local], device=accelerator.device))  # [processes]
    return [int(v) for v in held.tolist()]


def full_state_dict(model, fsdp: bool) -> dict[str, torch.Tensor]:
    """The whole model's tensors on the CPU (FSDP: gathered from every process; call on all)."""
    if not fsdp:
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


__all__ = ["full_state_dict", "hardware", "log_main", "shard_model", "sum_over_processes"]
