"""Build and load the CPU kernels (cpu_decode.c, cpu_decode_amx.c, cpu_prefill.c, cpu_prefill_amx.c) on first use.

Each kernel is compiled with the machine's C compiler (``$CC`` or ``cc``; -O3 -march=native) into
``$TRANSMLA_CACHE/kernels`` (default ~/.cache/transmla/kernels), once per shape (its -D defines)
and source version (the source and the shared headers are hashed into the file name), atomically
(a half-written library is never loaded), and loaded with ctypes (a call releases the GIL).
Each kernel is one ``CKernel`` (cpu_decode.KERNEL, cpu_prefill.KERNEL): the one loader, status and
AMX-permission code for both. Without a compiler, or when the build fails, ``CKernel.load`` returns None
with the reason in ``STATUS`` and callers keep PyTorch's SDPA: the kernels are optimisations, never
requirements. ``TRANSMLA_KERNEL=sdpa`` (backends.py) keeps the model off them.

The fp32 kernels use vectors of the CPU's own width (cpu_vector.h: 16 floats with AVX-512, else 8) with
register tiles sized for its register file; they were measured faster than PyTorch's SDPA on AVX-512
and on AVX2 CPUs (benchmarks/results/cpu_kernels.md), so ``fits`` takes them where the CPU has one of
those (``fast_vectors``), and anywhere when ``TRANSMLA_KERNEL=cpu`` forces them (tests, measurements).
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
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = ["CKernel", "DTYPES", "KERNEL_ENV", "STATUS", "build", "cpu_flags", "fits", "fast_vectors", "fp32_kernels_run", "pool"]

KERNEL_DIR = Path(__file__).parent  # the kernels' sources and the headers they include
HEADERS = tuple(sorted(KERNEL_DIR.glob("*.h")))  # cpu_vector.h, cpu_amx.h
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fPIC", "-shared", "-std=c11")
STATUS: dict[tuple, str] = {}  # {(kernel, dtype, *shape): "compiled" or "unavailable: why"}
KERNEL_ENV = "TRANSMLA_KERNEL"  # backends.py's variable: auto | a backend's name
# /proc/cpuinfo flags of the vector units the fp32 kernels were measured on: AVX-512, or AVX2 with FMA
VECTOR_FLAGS = ({"avx512f"}, {"avx2", "fma"})


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where it cannot be read: no Linux /proc)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return frozenset(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))


def fast_vectors() -> bool:
    """Does this CPU have a vector unit the fp32 kernels were measured fast on (VECTOR_FLAGS)? False where
    the flags cannot be read (another OS or architecture: not measured)."""
    return any(needed <= cpu_flags() for needed in VECTOR_FLAGS)


def fp32_kernels_run() -> bool:
    """Do the fp32 kernels take calls here: on CPUs with fast_vectors, or anywhere when TRANSMLA_KERNEL=cpu forces them."""
    return fast_vectors() or os.environ.get(KERNEL_ENV, "").strip().lower() == "cpu"


def _cache_dir() -> Path:
    return Path(os.environ.get("TRANSMLA_CACHE", Path.home() / ".cache" / "transmla")) / "kernels"


def fits(q_rows: torch.Tensor, rows: torch.Tensor, d_c: int, max_heads: int, dtype: torch.dtype = torch.float32) -> bool:
    """What every kernel needs: no autograd (the kernels have no backward), CPU, the kernel's
    dtype, q_rows [B, T, H, W] with H <= max_heads, rows [B, S, W] with contiguous rows (any batch
    stride), W and d_c multiples of 16, d_c <= W."""
    H, W = q_rows.shape[-2:]
    grad = torch.is_grad_enabled() and (q_rows.requires_grad or rows.requires_grad)
    return (not grad and q_rows.device.type == "cpu" and q_rows.dtype == dtype
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


DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16"}  # the kernels' dtypes; bf16 runs on AMX tiles


@dataclass
class CKernel:
    """One CPU kernel (decode or prefill): an fp32 C source and a bf16 AMX one, each built once per shape
    (query rows, row width, value width) and loaded with ctypes. ``load`` gives {symbol: function} or None,
    with the reason in ``status``; an AMX library also exports ``mla_amx_permit`` (cpu_amx.h), called once
    after loading to ask Linux for the tile state (None when refused)."""

    name: str  # "decode" | "prefill": the status key and the libraries' file stem
    sources: dict[str, Path]  # {"fp32": path, "bf16": path}
    symbols: dict[str, dict[str, tuple]]  # {"fp32": {symbol: (restype, argtypes)}, "bf16": {...}}
    max_heads: dict[str, int]  # query rows per sequence the kernel of each dtype holds
    heads_define: str = "H"  # the C macro of the query-row count
    _loaded: dict[tuple, dict | None] = field(default_factory=dict, repr=False)

    def fits(self, q_rows: torch.Tensor, rows: torch.Tensor, d_c: int) -> bool:
        """Can one of the kernels run these operands (module ``fits``, with that kernel's head limit)?"""
        dtype = DTYPES.get(q_rows.dtype)
        if dtype == "fp32" and not fp32_kernels_run():  # a CPU they were not measured on (module docstring)
            return False
        return dtype is not None and fits(q_rows, rows, d_c, self.max_heads[dtype], q_rows.dtype)

    def load(self, dtype: str, heads: int, width: int, d_c: int) -> dict | None:
        """{symbol: ctypes function} of the kernel of ``dtype`` ("fp32" | "bf16") for this shape, built on
        first use, or None (reason in ``status(dtype)``)."""
        key = (self.name, dtype, heads, width, d_c)
        if key not in self._loaded:
            self._loaded[key] = self._build_and_load(key, dtype, (f"-D{self.heads_define}={heads}",
                                                                  f"-DW={width}", f"-DDC={d_c}"))
        return self._loaded[key]

    def _build_and_load(self, key: tuple, dtype: str, defines: tuple[str, ...]) -> dict | None:
        amx = dtype == "bf16"
        symbols = {"mla_amx_permit": (ctypes.c_int, ()), **self.symbols[dtype]} if amx else self.symbols[dtype]
        stem = f"mla_{self.name}_{dtype}_" + "_".join(d[2:].replace("=", "").lower() for d in defines)
        try:
            lib = ctypes.CDLL(str(build(self.sources[dtype], stem, defines)))
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            STATUS[key] = f"unavailable: {exc}"
            return None
        functions = {}
        for name, (restype, argtypes) in symbols.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, list(argtypes)
            functions[name] = fn
        if amx and functions["mla_amx_permit"]() != 0:
            STATUS[key] = "unavailable: Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"
            return None
        STATUS[key] = "compiled"
        return functions

    def status(self, dtype: str = "fp32") -> dict[tuple, str]:
        """{(heads, width, d_c): "compiled" or "unavailable: why"} of every shape of the ``dtype`` kernel
        asked for so far in this process."""
        return {key[2:]: s for key, s in STATUS.items() if key[:2] == (self.name, dtype)}

    def forget(self) -> None:
        """Forget the loaded shapes (the next ``load`` builds or finds them again)."""
        for key in self._loaded:
            STATUS.pop(key, None)
        self._loaded.clear()


@functools.lru_cache(maxsize=1)
def pool(threads: int) -> ThreadPoolExecutor:
    """A thread pool for kernel calls (they release the GIL)."""
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="mla-kernel")
