"""The CPU prefill kernels: absorbed MLA attention of many query tokens, causal; fp32 in cpu_prefill.c
(portable C), bf16 in cpu_prefill_amx.c (AMX tiles; built only where the CPU has AMX-BF16).

PyTorch's fused SDPA on the CPU needs the value as wide as the key, so the absorbed prefill
(sdpa_rows.py: H query heads against one KV head, key = value = the cached row [c | k_r])
multiplies by all W columns of a row where the value is its first d_c: 9 x (96 + 96) multiply-adds
per query-key pair at 25% of SmolLM2's cache against 9 x (96 + 64) in the kernel, which also shares
each key block among all heads of 16 query tokens. Built on first use, once per shape (heads, row
width, value width), by ``KERNEL`` (cpu_build.CKernel); without a compiler, or when the build fails,
``KERNEL.load`` returns None with the reason in ``KERNEL.status`` and callers keep PyTorch's SDPA.

In bf16, PyTorch's SDPA can run on AMX, yet most of its time at long context is outside the products;
the AMX kernel does the scores and the value product in tiles (kernels/NOTES.md has the measurements).

Used for: CPU, fp32 or bf16, no autograd, causal without a padding mask (the T queries are the last T
of the S cached rows), width and value width multiples of 16. With several torch threads the query
blocks are dealt out to them in turn (the causal work grows with the position).
"""

from __future__ import annotations

import ctypes
import math
from pathlib import Path

import torch

from .cpu_build import CKernel, pool

__all__ = ["KERNEL", "MAX_HEADS", "mla_prefill_cpu", "supports"]

QUERY_BLOCK = 16  # query tokens per block (QB in cpu_prefill.c and cpu_prefill_amx.c)
KEY_BLOCK = 64  # keys per packed block (KB in both)
MAX_HEADS = 64
_P, _N = ctypes.c_void_p, ctypes.c_long
KERNEL = CKernel("prefill", {"fp32": Path(__file__).with_name("cpu_prefill.c"),
                             "bf16": Path(__file__).with_name("cpu_prefill_amx.c")},
                 {"fp32": {"mla_prefill_pack": (None, (_P, _N, _N, _N, _P)),
                           "mla_prefill_fp32": (ctypes.c_int, (_P, _P, _P, _N, _N, _P, _N, _N))},
                  "bf16": {"mla_prefill_amx_pack": (None, (_P, _N, _N, _N, _P, _P)),
                           "mla_prefill_amx": (ctypes.c_int, (_P, _P, _P, _N, _N, ctypes.c_float, _P, _N, _N))}},
                 {"fp32": MAX_HEADS, "bf16": MAX_HEADS})


def supports(q_rows: torch.Tensor, rows: torch.Tensor, d_c: int) -> bool:
    """Can a kernel run this call? q_rows [B, T, H, W], rows [B, S, W] with T <= S, fp32 or bf16."""
    return 0 < q_rows.shape[1] <= rows.shape[1] and KERNEL.fits(q_rows, rows, d_c)


def mla_prefill_cpu(q_rows: torch.Tensor, rows: torch.Tensor, d_c: int, softmax_scale: float) -> torch.Tensor | None:
    """o_lat [B, T, H, d_c] for q_rows [B, T, H, W] = [q_lat | q_rope] against rows [B, S, W] = [c | k_r]
    (query t sees rows s <= t + S - T), or None when no kernel can run here (the caller falls back)."""
    if not supports(q_rows, rows, d_c):
        return None
    B, T, H, W = q_rows.shape
    S = rows.shape[1]
    blocks = -(-S // KEY_BLOCK)
    if q_rows.dtype == torch.bfloat16:
        kernel = KERNEL.load("bf16", H, W, d_c)
        if kernel is None:
            return None
        q = q_rows.contiguous()  # [B, T, H, W]: the kernel scales the fp32 scores
        depth = -(-W // 32) * 32  # the row width padded to AMX's depth of 32
        keys = q.new_empty(B, blocks, depth * KEY_BLOCK)  # every sequence's keys and values in AMX's pair layout
        values = q.new_empty(B, blocks, KEY_BLOCK * d_c)
        kernel["mla_prefill_amx_pack"](rows.data_ptr(), rows.stride(0), B, S, keys.data_ptr(), values.data_ptr())
        scale2 = softmax_scale * math.log2(math.e)
        call = lambda b, out, first, threads: kernel["mla_prefill_amx"](
            q[b].data_ptr(), keys[b].data_ptr(), values[b].data_ptr(), T, S, scale2, out.data_ptr(), first, threads)
    else:
        kernel = KERNEL.load("fp32", H, W, d_c)
        if kernel is None:
            return None
        q = (q_rows * (softmax_scale * math.log2(math.e))).contiguous()  # [B, T, H, W]: the kernel's softmax is base 2
        packed = q.new_empty(B, blocks, W, KEY_BLOCK)  # every sequence's keys, transposed per block
        kernel["mla_prefill_pack"](rows.data_ptr(), rows.stride(0), B, S, packed.data_ptr())
        call = lambda b, out, first, threads: kernel["mla_prefill_fp32"](
            q[b].data_ptr(), packed[b].data_ptr(), rows[b].data_ptr(), T, S, out.data_ptr(), first, threads)
    out = q.new_empty(B, T, H, d_c)
    threads = max(1, min(torch.get_num_threads(), -(-T // QUERY_BLOCK)))

    def run(first: int) -> None:
        for b in range(B):
            if call(b, out[b], first, threads) != 0:
                raise MemoryError("the MLA prefill kernel could not allocate its block buffers")

    if threads == 1:
        run(0)
    else:
        list(pool(threads).map(run, range(threads)))
    return out
