"""The CPU decode kernels: absorbed MLA attention of one new token; fp32 in cpu_decode.c (portable C),
bf16 in cpu_decode_amx.c (AMX tiles; built only where the CPU has AMX-BF16).

PyTorch's fused SDPA on the CPU is compute-bound on one latent KV head shared by all query heads
(kernels/NOTES.md has the measurements); the C kernel reads each row once into L1 and does the
scores, an online softmax and the value product there. In bf16 the AMX kernel reads each cached row
as a tile and does the products on the matrix unit. They are built on first use, once per
shape (query rows, row width, value width), by ``KERNEL`` (cpu_build.CKernel); without a compiler (or AMX,
for bf16), or when the build fails, ``KERNEL.load`` returns None once with the reason in ``KERNEL.status``
and callers keep PyTorch's SDPA.

Used for: CPU, fp32 or bf16, one query token per sequence (decode), no padding mask, width and value
width multiples of 16, at most MAX_ROWS (fp32) or AMX_MAX_ROWS (bf16) query heads.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .cpu_build import CKernel, pool

__all__ = ["AMX_MAX_ROWS", "KERNEL", "MAX_ROWS", "mla_decode_cpu", "supports"]

MIN_PART_ROWS = 2048  # cached rows per thread below which one sequence is not split
MAX_ROWS = 64  # query rows (heads) per sequence: the kernel keeps M x d_c accumulators on its stack
AMX_MAX_ROWS = 16  # the bf16 kernel holds all heads of a sequence in the 16 lanes / tile rows
_ARGS = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long,
         ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
_RUN = {"fp32": "mla_decode_fp32", "bf16": "mla_decode_amx"}  # the entry point of each library
KERNEL = CKernel("decode", {"fp32": Path(__file__).with_name("cpu_decode.c"),
                            "bf16": Path(__file__).with_name("cpu_decode_amx.c")},
                 {dtype: {symbol: (None, _ARGS)} for dtype, symbol in _RUN.items()},
                 {"fp32": MAX_ROWS, "bf16": AMX_MAX_ROWS}, heads_define="M")


def supports(q_rows: torch.Tensor, rows: torch.Tensor, d_c: int) -> bool:
    """Can a kernel run this call? q_rows [B, 1, H, W], rows [B, S, W], fp32 or bf16."""
    return q_rows.shape[1] == 1 and KERNEL.fits(q_rows, rows, d_c)


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
    dtype = "bf16" if q_rows.dtype == torch.bfloat16 else "fp32"
    lib = KERNEL.load(dtype, H, W, d_c)
    if lib is None:
        return None
    fn = lib[_RUN[dtype]]
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
