"""The CPU decode kernels: absorbed MLA attention of one new token; fp32 in cpu_decode.c (portable C),
bf16 in cpu_decode_amx.c (AMX tiles; built only where the CPU has AMX-BF16).

PyTorch's fused SDPA on the CPU is compute-bound on one latent KV head shared by all query heads
(kernels/NOTES.md has the measurements); the C kernel reads each row once into L1 and does the
scores, an online softmax and the value product there. In bf16 the AMX kernel reads each cached row
as a tile and does the products on the matrix unit. They are built on first use, once per
shape (query rows, row width, value width), by cpu_build.py; without a compiler (or AMX, for bf16), or
when the build fails, ``decode_kernel`` / ``amx_decode_kernel`` return None once with the reason in
``kernel_status`` and callers keep PyTorch's SDPA. ``TRANSMLA_CPU_KERNEL=0`` turns them off.

Used for: CPU, fp32 or bf16, one query token per sequence (decode), no padding mask, width and value
width multiples of 16, at most MAX_ROWS (fp32) or AMX_MAX_ROWS (bf16) query heads.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from . import cpu_build
from .cpu_build import fits, load_amx_kernel, load_kernel, pool

__all__ = ["AMX_MAX_ROWS", "MAX_ROWS", "amx_decode_kernel", "decode_kernel", "kernel_status", "mla_decode_cpu",
           "supports"]

SOURCE = Path(__file__).with_name("cpu_decode.c")
AMX_SOURCE = Path(__file__).with_name("cpu_decode_amx.c")
MIN_PART_ROWS = 2048  # cached rows per thread below which one sequence is not split
MAX_ROWS = 64  # query rows (heads) per sequence: the kernel keeps M x d_c accumulators on its stack
AMX_MAX_ROWS = 16  # the bf16 kernel holds all heads of a sequence in the 16 lanes / tile rows
_ARGS = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long,
         ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]


def supports(q_rows: torch.Tensor, rows: torch.Tensor, d_c: int) -> bool:
    """Can a kernel run this call? q_rows [B, 1, H, W], rows [B, S, W], fp32 or bf16."""
    return q_rows.shape[1] == 1 and (fits(q_rows, rows, d_c, MAX_ROWS)
                                     or fits(q_rows, rows, d_c, AMX_MAX_ROWS, torch.bfloat16))


@functools.lru_cache(maxsize=None)
def decode_kernel(rows: int, width: int, d_c: int):
    """The compiled kernel's function for this shape, or None (reason in kernel_status())."""
    lib = load_kernel(("decode", rows, width, d_c), SOURCE, f"mla_decode_m{rows}_w{width}_dc{d_c}",
                      (f"-DM={rows}", f"-DW={width}", f"-DDC={d_c}"), {"mla_decode_fp32": (None, _ARGS)})
    return None if lib is None else lib["mla_decode_fp32"]


@functools.lru_cache(maxsize=None)
def amx_decode_kernel(rows: int, width: int, d_c: int):
    """The bf16 kernel's function for this shape, or None (reason in kernel_status("bf16")): no AMX-BF16
    in the CPU or compiler, or Linux did not grant the tile state."""
    lib = load_amx_kernel(("decode-bf16", rows, width, d_c), AMX_SOURCE, f"mla_decode_amx_m{rows}_w{width}_dc{d_c}",
                          (f"-DM={rows}", f"-DW={width}", f"-DDC={d_c}"), {"mla_decode_amx": (None, _ARGS)},
                          permit="mla_decode_amx_permit")
    return None if lib is None else lib["mla_decode_amx"]


def kernel_status(dtype: str = "fp32") -> dict[tuple, str]:
    """{(rows, width, d_c): "compiled" or "unavailable: why"} for every decode shape asked for so far, of
    the fp32 kernel or (dtype "bf16") the AMX one."""
    return cpu_build.kernel_status("decode" if dtype == "fp32" else "decode-bf16")


def mla_decode_cpu(q_rows: torch.Tensor, rows: torch.Tensor, d_c: int, softmax_scale: float) -> torch.Tensor | None:
    """o_lat [B, 1, H, d_c] for q_rows [B, 1, H, W] = [q_lat | q_rope] against rows [B, S, W] = [c | k_r]
    (in their dtype; the kernels accumulate in fp32), or None when no kernel can run here (the caller
    falls back). With several torch threads the
    work is split over them (the C call releases the GIL): by sequence when there are at least as
    many sequences as threads, else each sequence's cache in equal parts, merged by their
    log-sum-exp (a softmax over parts: out = sum_p 2^(m_p - m) acc_p / sum_p 2^(m_p - m) l_p)."""
    if not supports(q_rows, rows, d_c):
        return None
    B, _, H, W = q_rows.shape
    fn = (amx_decode_kernel if q_rows.dtype == torch.bfloat16 else decode_kernel)(H, W, d_c)
    if fn is None:
        return None
    S = rows.shape[1]
    q = q_rows.contiguous()
    item = q.element_size()  # bytes per value of q and rows; outputs and parts are fp32 (4 bytes)
    stride = rows.stride(0)
    threads = min(torch.get_num_threads(), max(B, S // MIN_PART_ROWS))  # >= 1
    if B >= threads:  # whole sequences per thread (all of them in one call on one thread)
        out = q.new_empty(B, 1, H, d_c, dtype=torch.float32)

        def run(b0: int, b1: int) -> None:
            fn(q.data_ptr() + b0 * H * W * item, rows.data_ptr() + b0 * stride * item, stride, b1 - b0, S,
               softmax_scale, out.data_ptr() + b0 * H * d_c * 4, None, None)

        if threads == 1:
            run(0, B)
        else:
            bounds = [B * i // threads for i in range(threads + 1)]
            list(pool(threads).map(run, bounds[:-1], bounds[1:]))
        return out.to(q.dtype)
    # fewer sequences than threads: each thread takes a part of every sequence's cache
    bounds = [S * i // threads for i in range(threads + 1)]
    acc = q.new_empty(threads, B, H, d_c, dtype=torch.float32)  # unnormalised parts
    part_max, part_sum = (q.new_empty(threads, B, H, dtype=torch.float32) for _ in range(2))

    def run_part(p: int) -> None:
        s0, s1 = bounds[p], bounds[p + 1]
        fn(q.data_ptr(), rows.data_ptr() + s0 * W * item, stride, B, s1 - s0, softmax_scale,
           acc[p].data_ptr(), part_max[p].data_ptr(), part_sum[p].data_ptr())

    list(pool(threads).map(run_part, range(threads)))
    weight = torch.exp2(part_max - part_max.amax(0))  # [parts, B, H]
    out = (weight[..., None] * acc).sum(0) / (weight * part_sum).sum(0)[..., None]  # [B, H, d_c]
    return out[:, None].to(q.dtype)
