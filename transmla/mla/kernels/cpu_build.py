"""Build and load the CPU kernels (cpu_decode.c, cpu_decode_amx.c, cpu_prefill.c, cpu_prefill_amx.c) on first use.

Each kernel is compiled with the machine's C compiler (``$CC`` or ``cc``; -O3 -march=native) into
``$TRANSMLA_CACHE/kernels`` (default ~/.cache/transmla/kernels), once per shape (its -D defines)
and source version (the source and the shared headers are hashed into the file name), atomically
(a half-written library is never loaded), and loaded with ctypes (a call releases the GIL).
Without a compiler, or when the build fails, ``load_kernel`` returns None with the reason in
``STATUS`` and callers keep PyTorch's SDPA: the kernels are optimisations, never requirements.
``TRANSMLA_CPU_KERNEL=0`` turns them off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

__all__ = ["ENV_OFF", "STATUS", "build", "enabled", "fits", "load_kernel", "pool"]

KERNEL_DIR = Path(__file__).parent  # the kernels' sources and the headers they include
HEADERS = tuple(sorted(KERNEL_DIR.glob("*.h")))  # cpu_vector.h, cpu_amx.h
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fPIC", "-shared", "-std=c11")
ENV_OFF = "TRANSMLA_CPU_KERNEL"
STATUS: dict[tuple, str] = {}  # {(kernel, *shape): "compiled" or "unavailable: why"}


def _cache_dir() -> Path:
    return Path(os.environ.get("TRANSMLA_CACHE", Path.home() / ".cache" / "transmla")) / "kernels"


def enabled() -> bool:
    return os.environ.get(ENV_OFF, "1").strip().lower() not in ("0", "false", "off", "no")


def fits(q_rows: torch.Tensor, rows: torch.Tensor, d_c: int, max_heads: int, dtype: torch.dtype = torch.float32) -> bool:
    """What every kernel needs: enabled, no autograd (the kernels have no backward), CPU, the kernel's
    dtype, q_rows [B, T, H, W] with H <= max_heads, rows [B, S, W] with contiguous rows (any batch
    stride), W and d_c multiples of 16, d_c <= W."""
    H, W = q_rows.shape[-2:]
    grad = torch.is_grad_enabled() and (q_rows.requires_grad or rows.requires_grad)
    return (enabled() and not grad and q_rows.device.type == "cpu" and q_rows.dtype == dtype
            and rows.dtype == dtype and H <= max_heads and W % 16 == 0 and d_c % 16 == 0
            and 0 < d_c <= W and rows.shape[-1] == W and rows.stride(-1) == 1 and rows.stride(1) == W)


def build(source: Path, stem: str, defines: tuple[str, ...]) -> Path:
    """Compile ``source`` with ``defines`` into the kernel cache (once per version and shape)."""
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler ({compiler!r} not found; set CC)")
    text = source.read_bytes() + b"".join(h.read_bytes() for h in HEADERS)
    key = hashlib.sha256(text + " ".join(FLAGS + defines + (compiler, platform.machine())).encode())
    target = _cache_dir() / f"{stem}_{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, f"-I{KERNEL_DIR}", *defines, str(source), "-o", tmp, "-lm"],
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            errors = [line for line in done.stderr.splitlines() if "error" in line] or [f"exit {done.returncode}"]
            raise RuntimeError(f"{compiler} failed: {errors[0].strip()}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load_kernel(key: tuple, source: Path, stem: str, defines: tuple[str, ...], symbols: dict[str, tuple]):
    """{name: ctypes function} of the library built from ``source``, or None (reason in STATUS[key]).
    ``symbols``: {name: (restype, argtypes)}."""
    try:
        lib = ctypes.CDLL(str(build(source, stem, defines)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        STATUS[key] = f"unavailable: {exc}"
        return None
    functions = {}
    for name, (restype, argtypes) in symbols.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, list(argtypes)
        functions[name] = fn
    STATUS[key] = "compiled"
    return functions


def load_amx_kernel(key: tuple, source: Path, stem: str, defines: tuple[str, ...], symbols: dict[str, tuple],
                    permit: str):
    """load_kernel for an AMX kernel, which also asks Linux for the tile state through its ``permit``
    symbol (arch_prctl ARCH_REQ_XCOMP_PERM, called once here); None when that is refused."""
    functions = load_kernel(key, source, stem, defines, {permit: (ctypes.c_int, ()), **symbols})
    if functions is not None and functions[permit]() != 0:
        STATUS[key] = "unavailable: Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"
        return None
    return functions


def kernel_status(kind: str) -> dict[tuple, str]:
    """{shape: "compiled" or "unavailable: why"} of every kernel of this kind ("decode", "prefill-bf16",
    ...) asked for so far in this process."""
    return {key[1:]: status for key, status in STATUS.items() if key[0] == kind}


@functools.lru_cache(maxsize=1)
def pool(threads: int) -> ThreadPoolExecutor:
    """A thread pool for kernel calls (they release the GIL)."""
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="mla-kernel")
