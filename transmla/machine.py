"""Where the numbers were measured: the machine record written beside every result (reports,
sweeps, generation benchmarks) and the GPU record of each decode-benchmark row. Two records,
because their written keys differ (report.json / sweep.json / bench JSON against the decode rows)."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any


def environment() -> dict[str, Any]:
    """Where the numbers were measured: machine, Python, torch, transformers."""
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    env = {
        "machine": f"{os.cpu_count()}-core CPU ({cpu}, {platform.machine()})",
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(terse=True),
        "threads": torch.get_num_threads(),
        "load_average": round(os.getloadavg()[0], 2),  # > 0 at the start: the machine was shared
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    return env


def gpu_environment(device) -> dict:
    """The GPU a decode benchmark ran on (its name, SMs, memory) and the torch / Triton / CUDA versions;
    a CPU dry run says so."""
    import torch
    import triton

    if device.type != "cuda":
        return dict(gpu="none (CPU dry run)", sm_count=None, gpu_memory_gb=None,
                    torch_version=torch.__version__, triton_version=triton.__version__,
                    cuda_version=torch.version.cuda)
    props = torch.cuda.get_device_properties(device)
    return dict(
        gpu=torch.cuda.get_device_name(device),
        sm_count=props.multi_processor_count,
        gpu_memory_gb=round(props.total_memory / 1e9, 1),
        torch_version=torch.__version__,
        triton_version=triton.__version__,
        cuda_version=torch.version.cuda,
    )


__all__ = ["environment", "gpu_environment"]
