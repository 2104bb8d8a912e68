"""The MLA attention kernels, one backend per device, each with a PyTorch reference twin.

The map (which module serves which call):
- CUDA decode: triton_decode.py, a Triton split-KV kernel over separate latent and rope tensors,
  reached through ``mla_decode`` below (reference.py is its twin);
- CPU decode and prompts: fused_rows.attend_rows over packed cache rows [c | k_r], which runs the C
  kernels of cpu_decode.py / cpu_prefill.py (fp32; AMX tiles in bf16 where the CPU has them, built
  by cpu_build.py on first use) and falls back to PyTorch's SDPA (``TRANSMLA_CPU_KERNEL=0`` forces it);
- triton_compile_report.py: a development aid (what sm_90 would get), not used at run time.
NOTES.md records the kernels' designs and measurements.

    mla_decode(q_lat, q_rope, latent, rope_key, softmax_scale, seq_lens=None, backend="auto")

backend: "auto" -> Triton when the tensors are on CUDA and triton imports, else the reference;
"triton" forces the kernel (error when impossible; CPU tensors allowed only when
TRITON_INTERPRET=1 was set before triton was imported); "torch" forces the reference.
With backend="auto", the environment variable TRANSMLA_ATTN_BACKEND (auto|triton|torch)
overrides the choice. Triton is imported lazily (first Triton call), never at package import.
"""

from __future__ import annotations

import functools
import os

import torch

from .reference import mla_decode_reference

__all__ = ["mla_decode", "mla_decode_reference", "available_backends", "resolve_backend", "BACKENDS"]

BACKENDS = ("auto", "triton", "torch")
ENV_VAR = "TRANSMLA_ATTN_BACKEND"


def _interpret_env() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


@functools.lru_cache(maxsize=None)
def _triton_import_error() -> str | None:
    try:
        import triton  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install
        return f"{type(exc).__name__}: {exc}"
    return None


def _triton_module():
    from . import triton_decode

    return triton_decode


def _triton_runs_on(device: torch.device) -> tuple[bool, str]:
    """Can the Triton kernel run on tensors of this device? (ok, reason when not)."""
    err = _triton_import_error()
    if err is not None:
        return False, f"triton is not importable ({err})"
    if device.type == "cuda":
        return True, ""
    # the interpreter is chosen when triton_decode is imported: both the env and the module agree
    if _interpret_env() and _triton_module().INTERPRET:
        return True, ""
    return False, (
        f"the Triton kernel needs CUDA tensors (got {device.type}); set TRITON_INTERPRET=1 before "
        "triton is imported to run it on the CPU interpreter"
    )


def available_backends(device: torch.device | str | None = None) -> list[str]:
    """Backends that can run here (on `device`, default: CUDA when available else CPU)."""
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    out = ["torch"]
    if _triton_runs_on(device)[0]:
        out.insert(0, "triton")
    return out


def resolve_backend(backend: str, device: torch.device) -> str:
    """Map "auto"/"triton"/"torch" (+ TRANSMLA_ATTN_BACKEND) to the concrete backend to run."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    if backend == "auto":
        env = os.environ.get(ENV_VAR, "").strip().lower()
        if env:
            if env not in BACKENDS:
                raise ValueError(f"{ENV_VAR}={env!r}: expected one of {BACKENDS}")
            backend = env
    if backend == "torch":
        return "torch"
    if backend == "triton":
        ok, why = _triton_runs_on(device)
        if not ok:
            raise RuntimeError(f"backend='triton' impossible: {why}")
        return "triton"
    # auto: the kernel on CUDA when triton imports, the reference elsewhere
    if device.type == "cuda" and _triton_import_error() is None:
        return "triton"
    return "torch"


def mla_decode(
    q_lat: torch.Tensor,  # [B, T_q, H, d_c]
    q_rope: torch.Tensor,  # [B, T_q, H, d_r]
    latent: torch.Tensor,  # [B, S, d_c]
    rope_key: torch.Tensor,  # [B, S, d_r]
    softmax_scale: float,
    seq_lens: torch.Tensor | None = None,  # [B] int, None = all S
    backend: str = "auto",
    **triton_kwargs,
) -> torch.Tensor:  # [B, T_q, H, d_c]
    """Absorbed MLA decode: o_lat = softmax((q_lat.c + q_rope.k_r) * scale) @ c (see reference.py).

    triton_kwargs (num_splits, block_h, block_n, num_warps, num_stages) reach the Triton kernel
    and are ignored by the reference.
    """
    which = resolve_backend(backend, q_lat.device)
    if which == "triton":
        return _triton_module().mla_decode_triton(
            q_lat, q_rope, latent, rope_key, softmax_scale, seq_lens, **triton_kwargs
        )
    return mla_decode_reference(q_lat, q_rope, latent, rope_key, softmax_scale, seq_lens)
