"""The one kernel dispatch of absorbed MLA attention: every kernel backend is one registered ``Backend``.

Every call has one layout (reference.py's notation): queries q_rows [B, T, H, d_c + d_r] = [q_lat | q_rope]
(the last T positions of the sequence), cache rows [B, S, d_c + d_r] = [c | k_r], and an optional boolean
mask [B|1, 1, T, S] (True = attend; None = bottom-right causal). A call of at most ``fold_max_queries``
queries is a decode step, a longer one a prompt (prefill). ``attend_rows`` tries the registered backends
in order and runs the first whose ``applies`` holds and whose entry for the phase returns a result; an
entry returns None for a call it cannot take (a shape outside its limits, a kernel that did not build),
and the next backend is tried. "sdpa" takes every call, last.

Built in, in dispatch order:
  triton  CUDA, no mask, decode steps: the split-KV Triton kernel (triton_decode.py)
  cpu     CPU, fp32 or bf16, no autograd, no mask: the C kernels (cpu_decode.py for one new token,
          cpu_prefill.py for prompts; AMX tiles in bf16 where the CPU has them), built on first use;
          fp32 where the CPU has AVX-512 or AVX2 (cpu_build.fast_vectors, the units they were measured on)
  torch   a GPU without Triton, no mask, decode steps: the PyTorch reference (reference.py)
  sdpa    everywhere, any mask: PyTorch's SDPA over the rows (sdpa_rows.py)

``TRANSMLA_KERNEL`` (auto | a registered name) forces one backend: it alone is tried, and the calls it
cannot take go to "sdpa" (so ``TRANSMLA_KERNEL=sdpa`` keeps every call off the kernels). Adding a backend:
``register(Backend(...))`` (docs/USAGE.md, "Adding a kernel backend"; tests/test_kernel_backends.py).
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from . import cpu_decode, cpu_prefill
from .cpu_build import KERNEL_ENV
from .reference import mla_decode_reference
from .sdpa_rows import sdpa_decode, sdpa_prefill

__all__ = ["ENV", "Backend", "attend_rows", "backends", "forced", "register", "triton_runs_on", "unregister"]

ENV = KERNEL_ENV
FALLBACK = "sdpa"
_REPLACED = {"TRANSMLA_ATTN_BACKEND": "TRANSMLA_KERNEL=triton|torch",  # old variables, now ignored
             "TRANSMLA_CPU_KERNEL": "TRANSMLA_KERNEL=sdpa (for =0)"}

# (q_rows, rows, d_c, softmax_scale, mask) -> o_lat [B, T, H, d_c], or None when it cannot take the call
Entry = Callable[[torch.Tensor, torch.Tensor, int, float, "torch.Tensor | None"], "torch.Tensor | None"]


@dataclass(frozen=True)
class Backend:
    """One kernel backend: where it applies and its two entry points (None: the phase is not its)."""

    name: str
    applies: Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], bool]  # (q_rows, rows, mask)
    decode: Entry | None = None  # a step of at most fold_max_queries new tokens
    prefill: Entry | None = None  # a prompt or a chunk of more
    auto: bool = True  # tried without TRANSMLA_KERNEL (False: only when forced)


_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend, before: str | None = FALLBACK) -> Backend:
    """Add (or replace) a backend, tried just before ``before`` (default: the "sdpa" fallback; None: last)."""
    _REGISTRY.pop(backend.name, None)
    items = list(_REGISTRY.items())
    at = next((i for i, (name, _) in enumerate(items) if name == before), len(items))
    items.insert(at, (backend.name, backend))
    _REGISTRY.clear()
    _REGISTRY.update(items)
    return backend


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def backends() -> list[Backend]:
    """The registered backends in dispatch order."""
    return list(_REGISTRY.values())


def forced() -> str | None:
    """The backend TRANSMLA_KERNEL names, or None for auto; ValueError for a name not registered."""
    for old, new in _REPLACED.items():
        if os.environ.get(old):
            _warn_replaced(old, new)
    name = os.environ.get(ENV, "").strip().lower()
    if name in ("", "auto"):
        return None
    if name not in _REGISTRY:
        raise ValueError(f"{ENV}={name!r}: expected auto or one of {sorted(_REGISTRY)}")
    return name


@functools.lru_cache(maxsize=None)
def _warn_replaced(old: str, new: str) -> None:
    warnings.warn(f"{old} is no longer read; use {new}", stacklevel=3)


def attend_rows(
    q_rows: torch.Tensor,  # [B, T, H, d_c + d_r] = [q_lat | q_rope]; the queries are the last T positions
    rows: torch.Tensor,  # [B, S, d_c + d_r] = [c | k_r]
    d_c: int,
    softmax_scale: float,
    mask: torch.Tensor | None = None,  # bool [B|1, 1, T, S], True = attend; None = bottom-right causal
    fold_max_queries: int = 8,
) -> torch.Tensor:  # [B, T, H, d_c]
    """Absorbed MLA attention of q_rows against rows in the first registered backend that takes the call."""
    T, S = q_rows.shape[1], rows.shape[1]
    if mask is not None and rows.device.type == "cpu" and _plain_causal(mask, T, S):  # (no device sync)
        mask = None  # e.g. transformers' mask for a chunk after the cache: the kernels and SDPA's causal flag
    phase = "decode" if T <= fold_max_queries else "prefill"
    name = forced()
    candidates = [b for b in _REGISTRY.values() if b.auto] if name is None else [_REGISTRY[name]]
    for backend in candidates:
        entry = getattr(backend, phase)
        if entry is not None and backend.applies(q_rows, rows, mask):
            out = entry(q_rows, rows, d_c, softmax_scale, mask)
            if out is not None:
                return out
    return getattr(_REGISTRY[FALLBACK], phase)(q_rows, rows, d_c, softmax_scale, mask)


def _plain_causal(mask: torch.Tensor, T: int, S: int) -> bool:
    """Is the boolean mask [B|1, 1, T, S] exactly the bottom-right causal one (no padding)? Checking
    costs B * T * S comparisons, a small part of the attention's B * T * S * H * W multiply-adds."""
    if mask.dtype != torch.bool or tuple(mask.shape[-2:]) != (T, S):
        return False
    limit = torch.arange(T, device=mask.device)[:, None] + (S - T)
    return bool((mask == (torch.arange(S, device=mask.device)[None, :] <= limit)).all())


def _split(q_rows: torch.Tensor, rows: torch.Tensor, d_c: int) -> tuple[torch.Tensor, ...]:
    """The separate-tensor layout (views): q_lat, q_rope [B, T, H, d], latent, rope_key [B, S, d]."""
    return q_rows[..., :d_c], q_rows[..., d_c:], rows[..., :d_c], rows[..., d_c:]


# -- triton -------------------------------------------------------------------------------------
def _interpret_env() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


@functools.lru_cache(maxsize=None)
def triton_import_error() -> str | None:
    """None when triton imports, else the error (imported lazily, never at package import)."""
    try:
        import triton  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install
        return f"{type(exc).__name__}: {exc}"
    return None


def triton_runs_on(device: torch.device) -> tuple[bool, str]:
    """Can the Triton kernel run on tensors of this device? (ok, reason when not)."""
    err = triton_import_error()
    if err is not None:
        return False, f"triton is not importable ({err})"
    if device.type == "cuda":
        return True, ""
    # the interpreter is chosen when triton_decode is imported: both the env and the module agree
    from . import triton_decode

    if _interpret_env() and triton_decode.INTERPRET:
        return True, ""
    return False, (
        f"the Triton kernel needs CUDA tensors (got {device.type}); set TRITON_INTERPRET=1 before "
        "triton is imported to run it on the CPU interpreter"
    )


def _triton_decode(q_rows, rows, d_c, softmax_scale, mask):
    from .triton_decode import mla_decode_triton

    return mla_decode_triton(*_split(q_rows, rows, d_c), softmax_scale)


# -- cpu: the C kernels -------------------------------------------------------------------------
def _profiled(name: str):
    """A named range for torch's profiler while one records (the C kernels' ctypes calls are invisible
    to it; `transmla bench generate --profile-steps`), else nothing."""
    return torch.profiler.record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


def _cpu_decode(q_rows, rows, d_c, softmax_scale, mask):
    if q_rows.shape[1] != 1:  # a few new tokens: SDPA's folded layout reads the cache once for all
        return None
    with _profiled("transmla::cpu_decode_kernel"):
        return cpu_decode.mla_decode_cpu(q_rows, rows, d_c, softmax_scale)  # None where it cannot run


def _cpu_prefill(q_rows, rows, d_c, softmax_scale, mask):
    with _profiled("transmla::cpu_prefill_kernel"):
        return cpu_prefill.mla_prefill_cpu(q_rows, rows, d_c, softmax_scale)  # None where it cannot run


# -- torch: the reference ------------------------------------------------------------------------
def _reference(q_rows, rows, d_c, softmax_scale, mask):
    return mla_decode_reference(*_split(q_rows, rows, d_c), softmax_scale)


register(Backend("triton", lambda q, rows, mask: mask is None and q.device.type == "cuda"
                 and triton_import_error() is None, decode=_triton_decode), before=None)
register(Backend("cpu", lambda q, rows, mask: mask is None and q.device.type == "cpu",
                 decode=_cpu_decode, prefill=_cpu_prefill), before=None)
register(Backend("torch", lambda q, rows, mask: mask is None and q.device.type != "cpu",
                 decode=_reference), before=None)
register(Backend(FALLBACK, lambda q, rows, mask: True, decode=sdpa_decode, prefill=sdpa_prefill), before=None)
