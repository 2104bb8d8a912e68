"""Triton split-KV kernel for absorbed MLA decode (see NOTES.md for the design and the numbers).

Same contract as `reference.mla_decode_reference` (read its docstring for the masking rules).

Grid of the main kernel: (head_blocks, splits, B), head blocks fastest so that the programs that
read the same latent tile run next to each other (L2 reuse when T_q*H needs several blocks).
The rows of a head block are the folded (t, h) pairs, m = t*H + h, so the T_q query tokens of a
sequence share every latent tile. Each program streams its split of the sequence in BLOCK_N
tiles; each latent tile [BLOCK_N, d_c] is loaded once and used twice: for the score
(q_lat @ tile^T, plus the small rope dot q_rope @ rope_tile^T) and for the value (p @ tile).
With several splits, each program writes a normalised partial output and its log-sum-exp
(base 2), and a second small kernel merges the splits; with one split the main kernel writes
the output directly.

Not supported (documented in NOTES.md): a paged cache / block table (the cache is dense
[B, S, d]; latent and rope_key may be column slices of one [B, S, d_c + d_r] buffer).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from .reference import check_decode_shapes

__all__ = ["mla_decode_triton", "default_config", "choose_num_splits", "smem_estimate", "INTERPRET"]

# triton decides interpreter-or-compiler when a function is decorated, i.e. at this import
INTERPRET = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")

_LOG2E = 1.4426950408889634


# No tl.max / tl.sum / tl.cdiv / tl.zeros in the kernels: those are @triton.jit helpers inside
# triton.language, and when triton was imported before TRITON_INTERPRET=1 was set (importing
# transformers -> torch._dynamo does that) they are compiled JITFunctions the interpreter cannot
# call. tl.reduce with triton's own combine functions is what tl.max/tl.sum do for fp32 on the
# GPU, and the interpreter recognises those objects and reduces with numpy (a combine function
# of our own would take its element-by-element Python path).
@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _sum_combine(a, b):
    return a + b


_MAX = getattr(tl.standard, "_elementwise_max", _max_combine)
_SUM = getattr(tl.standard, "_sum_combine", _sum_combine)


@triton.jit
def _mla_decode_split_kernel(
    Q_LAT, Q_ROPE, LATENT, ROPE, SEQ_LENS,
    O_PART, LSE_PART, OUT,
    qk_scale,  # softmax_scale * log2(e): scores live in base 2
    S, H, T_Q,
    stride_qlb, stride_qlt, stride_qlh,
    stride_qrb, stride_qrt, stride_qrh,
    stride_lb, stride_ls,
    stride_rb, stride_rs,
    stride_opb, stride_opm, stride_ops,
    stride_lpb, stride_lpm,
    stride_ob, stride_ot, stride_oh,
    D_C: tl.constexpr, D_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DC: tl.constexpr, BLOCK_DR: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HAS_SEQ_LENS: tl.constexpr,
    UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    pid_hb = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_b = tl.program_id(2)
    b64 = pid_b.to(tl.int64)

    M = T_Q * H
    offs_m = pid_hb * BLOCK_H + tl.arange(0, BLOCK_H)  # folded rows m = t*H + h
    m_valid = offs_m < M
    t = offs_m // H
    h = offs_m % H

    if HAS_SEQ_LENS:
        L = tl.load(SEQ_LENS + pid_b).to(tl.int32)
        L = tl.maximum(tl.minimum(L, S), 0)
    else:
        L = S
    lim = L - T_Q + t + 1  # [BLOCK_H]: row m sees keys n < lim (causal among new tokens)

    # this program's split [start, end) of [0, L), in whole tiles
    per_split = ((L + NUM_SPLITS - 1) // NUM_SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = pid_s * per_split
    end = tl.minimum(start + per_split, L)

    offs_dc = tl.arange(0, BLOCK_DC)
    dc_mask = offs_dc < D_C
    offs_n0 = tl.arange(0, BLOCK_N)

    q_ptrs = Q_LAT + b64 * stride_qlb + t[:, None] * stride_qlt + h[:, None] * stride_qlh + offs_dc[None, :]
    q = tl.load(q_ptrs, mask=m_valid[:, None] & dc_mask[None, :], other=0.0)  # [BLOCK_H, BLOCK_DC]
    if UPCAST:
        q = q.to(tl.float32)
    if D_R > 0:
        offs_dr = tl.arange(0, BLOCK_DR)
        dr_mask = offs_dr < D_R
        qr_ptrs = Q_ROPE + b64 * stride_qrb + t[:, None] * stride_qrt + h[:, None] * stride_qrh + offs_dr[None, :]
        qr = tl.load(qr_ptrs, mask=m_valid[:, None] & dr_mask[None, :], other=0.0)  # [BLOCK_H, BLOCK_DR]
        if UPCAST:
            qr = qr.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_H], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_H, BLOCK_DC], 0.0, dtype=tl.float32)

    lat_base = LATENT + b64 * stride_lb
    rope_base = ROPE + b64 * stride_rb
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + offs_n0
        n_mask = offs_n < end
        # the one load of this latent tile: used for the score and for the value
        kv = tl.load(
            lat_base + offs_n[:, None] * stride_ls + offs_dc[None, :],
            mask=n_mask[:, None] & dc_mask[None, :], other=0.0,
        )  # [BLOCK_N, BLOCK_DC]
        if UPCAST:
            kv = kv.to(tl.float32)
        s = tl.dot(q, tl.trans(kv), input_precision=INPUT_PRECISION)  # [BLOCK_H, BLOCK_N] fp32
        if D_R > 0:
            kr = tl.load(
                rope_base + offs_n[:, None] * stride_rs + offs_dr[None, :],
                mask=n_mask[:, None] & dr_mask[None, :], other=0.0,
            )  # [BLOCK_N, BLOCK_DR]
            if UPCAST:
                kr = kr.to(tl.float32)
            s += tl.dot(qr, tl.trans(kr), input_precision=INPUT_PRECISION)
        s = s * qk_scale
        keep = (offs_n[None, :] < lim[:, None]) & n_mask[None, :]
        s = tl.where(keep, s, float("-inf"))

        # online softmax, safe for rows that have seen nothing yet (m = -inf)
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _MAX))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, _SUM)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(kv.dtype), kv, acc, input_precision=INPUT_PRECISION)  # [BLOCK_H, BLOCK_DC]
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    if NUM_SPLITS == 1:
        o_ptrs = OUT + b64 * stride_ob + t[:, None] * stride_ot + h[:, None] * stride_oh + offs_dc[None, :]
        tl.store(o_ptrs, o.to(OUT.dtype.element_ty), mask=m_valid[:, None] & dc_mask[None, :])
    else:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        op_ptrs = (O_PART + b64 * stride_opb + offs_m[:, None] * stride_opm + pid_s * stride_ops
                   + offs_dc[None, :])
        tl.store(op_ptrs, o, mask=m_valid[:, None] & dc_mask[None, :])
        tl.store(LSE_PART + b64 * stride_lpb + offs_m * stride_lpm + pid_s, lse, mask=m_valid)


@triton.jit
def _mla_decode_merge_kernel(
    O_PART, LSE_PART, OUT,
    H,
    stride_opb, stride_opm, stride_ops,
    stride_lpb, stride_lpm,
    stride_ob, stride_ot, stride_oh,
    D_C: tl.constexpr, BLOCK_DC: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_b = tl.program_id(1)
    b64 = pid_b.to(tl.int64)
    t = pid_m // H
    h = pid_m % H

    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < NUM_SPLITS
    offs_dc = tl.arange(0, BLOCK_DC)
    dc_mask = offs_dc < D_C

    lse = tl.load(LSE_PART + b64 * stride_lpb + pid_m * stride_lpm + offs_s, mask=s_mask,
                  other=float("-inf"))  # [BLOCK_S], base 2
    mx = tl.reduce(lse, 0, _MAX)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp2(lse - mx)  # 0 for empty splits
    denom = tl.reduce(w, 0, _SUM)
    denom = tl.where(denom == 0.0, 1.0, denom)
    o = tl.load(
        O_PART + b64 * stride_opb + pid_m * stride_opm + offs_s[:, None] * stride_ops + offs_dc[None, :],
        mask=s_mask[:, None] & dc_mask[None, :], other=0.0,
    )  # [BLOCK_S, BLOCK_DC]
    out = tl.reduce(o * w[:, None], 0, _SUM) / denom
    tl.store(OUT + b64 * stride_ob + t * stride_ot + h * stride_oh + offs_dc,
             out.to(OUT.dtype.element_ty), mask=dc_mask)


@functools.lru_cache(maxsize=None)
def _device_limits(device_index: int) -> tuple[int, int]:
    """(SM count, opt-in shared memory per block in bytes) of a CUDA device."""
    props = torch.cuda.get_device_properties(device_index)
    try:  # what triton itself checks kernels against (227 KiB on H100)
        from triton.runtime import driver

        smem = int(driver.active.utils.get_device_properties(device_index)["max_shared_mem"])
    except Exception:
        per_sm = int(getattr(props, "shared_memory_per_multiprocessor", 0) or 0)
        smem = per_sm - 1024 if per_sm > 0 else 99 * 1024
    return props.multi_processor_count, smem


def smem_estimate(block_h: int, block_n: int, block_dc: int, block_dr: int, num_stages: int,
                  elem: int) -> int:
    """Shared memory of the split kernel in bytes (matches triton 3.9's allocation on sm_90:
    num_stages - 1 latent+rope buffers, the query tile, the p tile)."""
    row = block_dc + block_dr
    return ((num_stages - 1) * block_n * row + block_h * row + block_h * block_n) * elem


def _cdiv(a: int, b: int) -> int:
    """Host-side ceil(a / b). Not triton.cdiv: that is a constexpr function whose wrapper costs
    ~5 us a call, and choose_num_splits calls it ~200 times per decode step (it was the host floor
    of a decode step on the GPU: benchmarks/results/gpu_check)."""
    return -(-a // b)


def _next_pow2(n: int) -> int:
    """Host-side next power of two >= n (n >= 1), like triton.next_power_of_2 without its wrapper."""
    return 1 << max(n - 1, 0).bit_length()


def choose_num_splits(batch: int, head_blocks: int, rows: int, seq: int, slots: int, block_n: int,
                      token_bytes: int, d_c: int, max_splits: int = 64, min_tokens: int = 256) -> int:
    """Split count minimising a per-SM time model (in bytes moved by one SM): every program of
    a wave streams its split at the same rate, so the cache part is
    ceil(programs / slots) * tokens_per_split * token_bytes; the partial outputs add
    batch * rows * splits * d_c * 8 bytes (fp32 write + read) spread over the slots. Ties (within
    2%) go to fewer splits. slots = SMs x resident programs per SM."""
    programs = max(batch * head_blocks, 1)
    hi = max(1, min(max_splits, _cdiv(seq, min_tokens)))
    best, best_cost = 1, None
    for ns in range(1, hi + 1):
        per = _cdiv(_cdiv(seq, ns), block_n) * block_n
        cost = _cdiv(programs * ns, slots) * per * token_bytes
        if ns > 1:
            cost += batch * rows * ns * d_c * 8 / slots
        if best_cost is None or cost < best_cost * 0.98:
            best, best_cost = ns, cost
    return best


def default_config(
    batch: int, rows: int, seq: int, d_c: int, d_r: int, dtype: torch.dtype, device: torch.device
) -> dict:
    """Launch parameters chosen from the shape (rows = T_q * H); see NOTES.md.

    BLOCK_H covers all rows of a sequence when they fit (then each latent tile is read once per
    split), capped at 32 for d_c > 256 or fp32 (accumulator registers), 64 otherwise; >= 16 for
    tl.dot. Warps give each thread <= 64 fp32 accumulator elements, except 16-bit caches with
    d_c >= 512, which take 64-row tiles on 4 warps (measured on the H200 at 32 heads, d_c 512,
    batch 32, 16K: 74% of the copy bandwidth against 40% for 32-row tiles on 8 warps;
    benchmarks/results/gpu_check). Pipeline depth: as many stages as fit in ~70% of the opt-in
    shared memory (at most 4; all of it for those wide 16-bit tiles, whose third stage was the
    measured gain). Splits: `choose_num_splits`. The other shapes keep the choice made from
    compile-only register/shared-memory reports for sm_90.
    """
    elem = torch.empty((), dtype=dtype).element_size()
    block_dc = max(16, _next_pow2(d_c))
    block_dr = max(16, _next_pow2(d_r)) if d_r > 0 else 0
    wide16 = block_dc >= 512 and elem == 2
    cap = 32 if (block_dc >= 512 or elem == 4) else 64
    block_h = min(cap, max(16, _next_pow2(rows)))
    block_n = 32 if elem == 4 else 64  # 16-bit: 64 rows, at d_c >= 512 too (wide16)
    num_warps = 4 if wide16 else max(4, min(8, block_h * block_dc // 2048))
    if device.type == "cuda" and not INTERPRET:
        sms, smem_optin = _device_limits(
            device.index if device.index is not None else torch.cuda.current_device())
    else:
        sms, smem_optin = 4, 227 * 1024  # interpreter: few programs
    budget = smem_optin if wide16 else int(0.7 * smem_optin)
    num_stages = 2
    for st in (4, 3):
        if smem_estimate(block_h, block_n, block_dc, block_dr, st, elem) <= budget:
            num_stages = st
            break
    smem = smem_estimate(block_h, block_n, block_dc, block_dr, num_stages, elem)
    # resident programs per SM: shared memory, and the register file (64K registers) at ~128 a thread for
    # 4 warps; 8 warps kept at 1. With 4 on the H200 the split heuristic picks what its graph-timed launch
    # search found best for small rows (SmolLM2 25%: 16 splits at batch 32 / 16K, 70.7% of copy against 65.5%
    # with 8; 64 at batch 8, 43.5% against 41.6%), and the wide 16-bit tiles stay at 1 (shared memory).
    per_sm = max(1, min(smem_optin // max(smem, 1), 4 if num_warps <= 4 else 1))
    head_blocks = _cdiv(rows, block_h)
    num_splits = choose_num_splits(batch, head_blocks, rows, seq, sms * per_sm, block_n,
                                   (d_c + d_r) * elem, d_c)
    return dict(block_h=block_h, block_n=block_n, num_splits=num_splits,
                num_warps=num_warps, num_stages=num_stages)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if (x.shape[-1] <= 1 or x.stride(-1) == 1) else x.contiguous()


def mla_decode_triton(
    q_lat: torch.Tensor,  # [B, T_q, H, d_c]
    q_rope: torch.Tensor,  # [B, T_q, H, d_r]
    latent: torch.Tensor,  # [B, S, d_c]
    rope_key: torch.Tensor,  # [B, S, d_r]
    softmax_scale: float,
    seq_lens: torch.Tensor | None = None,  # [B] int, None = all S
    *,
    num_splits: int | None = None,
    block_h: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:  # [B, T_q, H, d_c] in q_lat's dtype
    """Absorbed MLA decode with the Triton split-KV kernel (CUDA, or CPU under TRITON_INTERPRET=1).

    Inputs: fp32 / fp16 / bf16 (q and cache of one dtype), fp32 accumulation. d_c and d_r need
    not be powers of two (masked); d_r may be 0. Tuning kwargs default to `default_config`.
    No host synchronisation (CUDA-graph friendly).
    """
    B, T_q, H, S, d_c, d_r = check_decode_shapes(q_lat, q_rope, latent, rope_key, seq_lens)
    dev = q_lat.device
    if dev.type != "cuda" and not INTERPRET:
        raise RuntimeError("mla_decode_triton needs CUDA tensors (or TRITON_INTERPRET=1 before importing triton)")
    for name, x in (("q_rope", q_rope), ("latent", latent), ("rope_key", rope_key)):
        if x.device != dev:
            raise ValueError(f"{name} is on {x.device}, q_lat on {dev}")
    dtype = q_lat.dtype
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"unsupported dtype {dtype} (fp32, fp16, bf16)")
    if not (q_rope.dtype == latent.dtype == rope_key.dtype == dtype):
        raise TypeError("q_lat, q_rope, latent and rope_key must share one dtype")
    if d_c < 1:
        raise ValueError("d_c must be >= 1")

    q_lat, q_rope, latent, rope_key = map(_last_dim_contiguous, (q_lat, q_rope, latent, rope_key))
    out = torch.empty((B, T_q, H, d_c), device=dev, dtype=dtype)
    if B == 0 or T_q == 0 or H == 0:
        return out
    if S == 0:
        return out.zero_()

    rows = T_q * H
    cfg = default_config(B, rows, S, d_c, d_r, dtype, dev)
    if num_splits is not None:
        cfg["num_splits"] = int(num_splits)
    if block_h is not None:
        cfg["block_h"] = int(block_h)
    if block_n is not None:
        cfg["block_n"] = int(block_n)
    if num_warps is not None:
        cfg["num_warps"] = int(num_warps)
    if num_stages is not None:
        cfg["num_stages"] = int(num_stages)
    for k in ("block_h", "block_n"):
        v = cfg[k]
        if v < 16 or v & (v - 1):
            raise ValueError(f"{k} must be a power of two >= 16 (tl.dot); got {v}")
    if cfg["num_splits"] < 1:
        raise ValueError("num_splits must be >= 1")

    block_dc = max(16, _next_pow2(d_c))
    block_dr = max(16, _next_pow2(max(d_r, 1)))
    head_blocks = _cdiv(rows, cfg["block_h"])
    ns = cfg["num_splits"]

    # bf16 tl.dot is wrong in the CPU interpreter: compute the dots in fp32 there
    upcast = INTERPRET and dtype == torch.bfloat16
    precision = "ieee" if (dtype == torch.float32 or upcast) else "tf32"

    if seq_lens is not None:
        seq_lens = seq_lens.to(device=dev, dtype=torch.int32)
        sl_arg = seq_lens
    else:
        sl_arg = q_lat  # never read (HAS_SEQ_LENS=False)
    if ns > 1:
        o_part = torch.empty((B, rows, ns, d_c), device=dev, dtype=torch.float32)
        lse_part = torch.empty((B, rows, ns), device=dev, dtype=torch.float32)
    else:
        o_part = lse_part = out  # never written (NUM_SPLITS=1 stores to OUT)

    rs_b, rs_s = (rope_key.stride(0), rope_key.stride(1)) if d_r > 0 else (0, 0)
    op_strides = (o_part.stride(0), o_part.stride(1), o_part.stride(2)) if ns > 1 else (0, 0, 0)
    lp_strides = (lse_part.stride(0), lse_part.stride(1)) if ns > 1 else (0, 0)

    grid = (head_blocks, ns, B)
    _mla_decode_split_kernel[grid](
        q_lat, q_rope, latent, rope_key, sl_arg,
        o_part, lse_part, out,
        float(softmax_scale) * _LOG2E,
        S, H, T_q,
        q_lat.stride(0), q_lat.stride(1), q_lat.stride(2),
        q_rope.stride(0), q_rope.stride(1), q_rope.stride(2),
        latent.stride(0), latent.stride(1),
        rs_b, rs_s,
        *op_strides,
        *lp_strides,
        out.stride(0), out.stride(1), out.stride(2),
        D_C=d_c, D_R=d_r,
        BLOCK_H=cfg["block_h"], BLOCK_N=cfg["block_n"],
        BLOCK_DC=block_dc, BLOCK_DR=block_dr,
        NUM_SPLITS=ns, HAS_SEQ_LENS=seq_lens is not None,
        UPCAST=upcast, INPUT_PRECISION=precision,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if ns > 1:
        _mla_decode_merge_kernel[(rows, B)](
            o_part, lse_part, out,
            H,
            *op_strides,
            *lp_strides,
            out.stride(0), out.stride(1), out.stride(2),
            D_C=d_c, BLOCK_DC=block_dc,
            NUM_SPLITS=ns, BLOCK_S=max(2, _next_pow2(ns)),
            num_warps=4 if block_dc >= 256 else 2,
        )
    return out

