"""The MLA attention kernels: one dispatch (backends.py) over registered backends, each with the PyTorch
reference (reference.py) as its twin in the tests.

The map (which module serves which call):
- backends.py: the registry and ``attend_rows`` (what mla/attention.py calls), one ``Backend`` per kernel:
  triton (CUDA decode: triton_decode.py), cpu (the C kernels of cpu_decode.py / cpu_prefill.py, fp32,
  AMX tiles in bf16 where the CPU has them, built and loaded by cpu_build.CKernel on first use),
  torch (the reference, for a GPU without Triton) and sdpa (PyTorch's SDPA, sdpa_rows.py: every call
  the others do not take). ``TRANSMLA_KERNEL`` (auto | a backend name) forces one.
- ``mla_decode`` below: the Triton kernel or the reference on separate latent and rope tensors with
  per-sequence lengths (the benchmarks' and the kernel tests' entry point).
NOTES.md records the kernels' designs and measurements; tools/triton_compile_report.py reports what
the Triton kernel would get on an NVIDIA arch without a GPU.

    mla_decode(q_lat, q_rope, latent, rope_key, softmax_scale, seq_lens=None, backend="auto")

backend: "auto" -> Triton when the tensors are on CUDA and triton imports, else the reference;
"triton" forces the kernel (error when impossible; CPU tensors allowed only when
TRITON_INTERPRET=1 was set before triton was imported); "torch" forces the reference.
With backend="auto", TRANSMLA_KERNEL=triton|torch overrides the choice (other backends take packed rows
only, so other names leave it to auto). Triton is imported lazily (first Triton call), never at import.
"""

from __future__ import annotations

import torch

from .backends import forced, triton_import_error, triton_runs_on
from .reference import mla_decode_reference

__all__ = ["mla_decode", "mla_decode_reference", "available_backends", "resolve_backend", "BACKENDS"]

BACKENDS = ("auto", "triton", "torch")


def available_backends(device: torch.device | str | None = None) -> list[str]:
    """Backends of ``mla_decode`` that can run here (on `device`, default: CUDA when available else CPU)."""
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    out = ["torch"]
    if triton_runs_on(device)[0]:
        out.insert(0, "triton")
    return out


def resolve_backend(backend: str, device: torch.device) -> str:
    """Map "auto"/"triton"/"torch" (+ TRANSMLA_KERNEL) to the concrete backend of ``mla_decode``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    if backend == "auto":
        env = forced()  # ValueError for a name that is not a registered backend
        if env in BACKENDS:
            backend = env
    if backend == "torch":
        return "torch"
    if backend == "triton":
        ok, why = triton_runs_on(device)
        if not ok:
            raise RuntimeError(f"backend='triton' impossible: {why}")
        return "triton"
    # auto: the kernel on CUDA when triton imports, the reference elsewhere
    if device.type == "cuda" and triton_import_error() is None:
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
        from .triton_decode import mla_decode_triton

        return mla_decode_triton(q_lat, q_rope, latent, rope_key, softmax_scale, seq_lens, **triton_kwargs)
    return mla_decode_reference(q_lat, q_rope, latent, rope_key, softmax_scale, seq_lens)

