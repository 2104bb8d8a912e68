"""Decode-step benchmark: absorbed MLA (Triton kernel, unfused PyTorch reference) against the
GQA source cache read by torch SDPA, as bytes/s and as a fraction of the GPU's measured copy
bandwidth. GPU only (CUDA); every entry point raises `BenchUnavailable` elsewhere.

One decode step of one layer, B sequences of T cached tokens, T_q new query tokens each:
  MLA: reads B*T*(d_c + d_r) cache elements (+ queries, + output), 2*B*T_q*H*T*(2*d_c + d_r) FLOPs
  GQA: reads B*T*2*n_kv*d cache elements (+ queries, + output), 4*B*T_q*H*T*d FLOPs
Timing: triton.testing.do_bench (it flushes L2 before every timed call), median, after warm-up,
rotating among several input sets when one set is small enough to stay in L2.

`dry_run=True` (tests, plumbing checks) runs the same code on the CPU with wall-clock timing, the
Triton kernel under TRITON_INTERPRET=1: every number it gives is meaningless.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from dataclasses import dataclass

import torch

from ..dtypes import torch_dtype
from ..machine import gpu_environment

__all__ = [
    "BenchUnavailable",
    "DecodeShape",
    "require_cuda",
    "mla_traffic",
    "gqa_traffic",
    "measure_copy_bandwidth",
    "estimate_peak_bytes",
    "fit_batch",
    "bench_decode",
    "tune_mla_triton",
]

IMPLS = ("mla_triton", "mla_torch_reference", "gqa_sdpa")


class BenchUnavailable(RuntimeError):
    """The benchmark cannot run here (no CUDA device, or no triton)."""


@dataclass(frozen=True)
class DecodeShape:
    batch: int = 64
    context: int = 8192  # T: cached tokens per sequence (including the new ones)
    heads: int = 32  # H query heads
    kv_lora_rank: int = 512  # d_c
    rope_dim: int = 64  # d_r
    gqa_kv_heads: int = 8  # source cache: n_kv heads ...
    gqa_head_dim: int = 128  # ... of head_dim d
    t_q: int = 1  # new query tokens per sequence (speculative decoding: 1..4)
    dtype: str = "bf16"

    def __post_init__(self):
        torch_dtype(self.dtype)  # ValueError on a bad name
        for f in ("batch", "context", "heads", "kv_lora_rank", "gqa_kv_heads", "gqa_head_dim", "t_q"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f} must be >= 1")
        if self.rope_dim < 0:
            raise ValueError("rope_dim must be >= 0")
        if self.heads % self.gqa_kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of gqa_kv_heads ({self.gqa_kv_heads})")
        if self.t_q > self.context:
            raise ValueError("t_q must be <= context")

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def elem(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()


def require_cuda(dry_run: bool = False) -> torch.device:
    if dry_run:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise BenchUnavailable("the decode benchmark needs a CUDA GPU (torch.cuda.is_available() is False)")
    return torch.device("cuda", torch.cuda.current_device())


def mla_traffic(s: DecodeShape) -> dict:
    """Bytes and FLOPs of one absorbed-MLA decode step (the floor any kernel must move)."""
    d_c, d_r, e = s.kv_lora_rank, s.rope_dim, s.elem
    kv = s.batch * s.context * (d_c + d_r) * e
    q = s.batch * s.t_q * s.heads * (d_c + d_r) * e
    out = s.batch * s.t_q * s.heads * d_c * e
    flops = 2 * s.batch * s.t_q * s.heads * s.context * (2 * d_c + d_r)
    return dict(kv_bytes=kv, bytes=kv + q + out, flops=flops, cache_elems_per_token=d_c + d_r)


def gqa_traffic(s: DecodeShape) -> dict:
    """Bytes and FLOPs of one decode step on the GQA source cache (K and V, n_kv heads x d)."""
    g, d, e = s.gqa_kv_heads, s.gqa_head_dim, s.elem
    kv = s.batch * s.context * 2 * g * d * e
    q = out = s.batch * s.t_q * s.heads * d * e
    flops = 4 * s.batch * s.t_q * s.heads * s.context * d
    return dict(kv_bytes=kv, bytes=kv + q + out, flops=flops, cache_elems_per_token=2 * g * d)


def _do_bench(fn, warmup: int, rep: int, device: torch.device | None = None) -> float:
    """Median milliseconds of fn() (triton.testing.do_bench); wall clock for CPU dry runs."""
    if device is not None and device.type != "cuda":
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def _do_bench_graph(fn, rep: int, device: torch.device) -> float | None:
    """Median milliseconds of fn() replayed from a CUDA graph (triton.testing.do_bench_cudagraph: the
    calls are captured once, so no Python or launch overhead is timed, as in a server that replays
    its decode step from a graph); None on the CPU or when fn cannot be captured. The graph holds
    many calls, each capturing the next input set of fn's rotation, so replays still stream the cache
    from memory rather than from L2."""
    if device.type != "cuda":
        return None
    import triton.testing

    try:
        return float(triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median"))
    except Exception:  # a call that syncs or cannot be captured: the plain timing stands alone
        return None


def _empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure_copy_bandwidth(device: torch.device | None = None, nbytes: int = 1 << 30,
                           warmup: int = 25, rep: int = 200) -> float:
    """Device-to-device copy bandwidth in GB/s, counting read + write bytes (2 * nbytes / t)."""
    device = device or require_cuda()
    if device.type != "cuda":
        nbytes = min(nbytes, 1 << 24)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = _do_bench(lambda: dst.copy_(src), warmup, rep, device)
    del src, dst
    _empty_cache(device)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _l2_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 50 << 20
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20) or (50 << 20))


def _n_sets(set_bytes: int, l2: int, cap: int = 8) -> int:
    """Enough input sets that rotating among them spans >= 3x the L2 cache."""
    return max(1, min(cap, math.ceil(3 * l2 / max(set_bytes, 1))))


def estimate_peak_bytes(s: DecodeShape, impls=IMPLS, l2_bytes: int = 50 << 20) -> int:
    """Peak device memory of `bench_decode` (implementations run one after another)."""
    e, d_c, d_r = s.elem, s.kv_lora_rank, s.rope_dim
    mla = mla_traffic(s)
    peaks = [2 << 30]  # copy-bandwidth buffers
    mla_set = mla["bytes"] + s.batch * s.t_q * s.heads * 64 * (d_c + 1) * 4  # + split partials
    if "mla_triton" in impls:
        peaks.append(_n_sets(mla_set, l2_bytes) * mla_set)
    if "mla_torch_reference" in impls:
        f32 = max(e, 4)
        temps = 2 * s.batch * s.context * (d_c + d_r) * f32  # upcast + masked copy of the cache
        temps += 4 * s.batch * s.t_q * s.heads * s.context * f32  # scores, mask, softmax, p
        peaks.append(_n_sets(mla_set, l2_bytes) * mla_set + temps)
    if "gqa_sdpa" in impls:
        gqa = gqa_traffic(s)["bytes"]
        peaks.append(_n_sets(gqa, l2_bytes) * gqa + s.batch * s.t_q * s.heads * s.context * 4)
    return int(max(peaks) * 1.1)


def fit_batch(s: DecodeShape, limit_bytes: float = 60e9, impls=IMPLS) -> DecodeShape:
    """Halve the batch until the benchmark's estimated peak memory is under limit_bytes."""
    while s.batch > 1 and estimate_peak_bytes(s, impls) > limit_bytes:
        s = dataclasses.replace(s, batch=max(1, s.batch // 2))
    return s


# ---------------------------------------------------------------------- inputs and callables


def _mla_inputs(s: DecodeShape, device, gen):
    dt = s.torch_dtype
    B, T, H, d_c, d_r = s.batch, s.context, s.heads, s.kv_lora_rank, s.rope_dim
    cache = torch.randn(B, T, d_c + d_r, device=device, dtype=dt, generator=gen)  # one buffer
    q = torch.randn(B, s.t_q, H, d_c + d_r, device=device, dtype=dt, generator=gen)
    seq_lens = torch.full((B,), T, device=device, dtype=torch.int32)
    return (q[..., :d_c], q[..., d_c:], cache[..., :d_c], cache[..., d_c:], seq_lens)


def _gqa_inputs(s: DecodeShape, device, gen):
    dt = s.torch_dtype
    B, T, H, g, d = s.batch, s.context, s.heads, s.gqa_kv_heads, s.gqa_head_dim
    k = torch.randn(B, g, T, d, device=device, dtype=dt, generator=gen)
    v = torch.randn(B, g, T, d, device=device, dtype=dt, generator=gen)
    # queries grouped by KV head, rows ordered (t, head-in-group): plain MHA over g heads
    q = torch.randn(B, g, s.t_q * (H // g), d, device=device, dtype=dt, generator=gen)
    return q, k, v


def _gqa_mask(s: DecodeShape, device):
    if s.t_q == 1:
        return None
    n = s.heads // s.gqa_kv_heads
    t = torch.arange(s.t_q, device=device).repeat_interleave(n)  # row -> query token
    lim = s.context - s.t_q + t + 1
    return torch.arange(s.context, device=device)[None, :] < lim[:, None]  # [t_q*n, T]


def _make_fn(impl: str, s: DecodeShape, sets, triton_kwargs: dict | None, device):
    scale = 1.0 / math.sqrt(s.kv_lora_rank + s.rope_dim)
    cyc = itertools.cycle(range(len(sets)))
    if impl == "mla_triton":
        from transmla.mla.kernels.triton_decode import mla_decode_triton

        kw = dict(triton_kwargs or {})
        return lambda: mla_decode_triton(*sets[next(cyc)][:4], scale, sets[0][4], **kw)
    if impl == "mla_torch_reference":
        from transmla.mla.kernels.reference import mla_decode_reference

        return lambda: mla_decode_reference(*sets[next(cyc)][:4], scale, sets[0][4])
    if impl == "gqa_sdpa":
        import torch.nn.functional as F

        mask = _gqa_mask(s, device)
        gscale = 1.0 / math.sqrt(s.gqa_head_dim)

        def run():
            q, k, v = sets[next(cyc)]
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=gscale)

        return run
    raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")


def _gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def _row(impl, s: DecodeShape, ms, traffic, copy_gbps, env, extra=None) -> dict:
    gbps = _gbps(traffic["bytes"], ms)
    row = dict(
        impl=impl, batch=s.batch, context=s.context, heads=s.heads, t_q=s.t_q,
        kv_lora_rank=s.kv_lora_rank, rope_dim=s.rope_dim, gqa_kv_heads=s.gqa_kv_heads,
        gqa_head_dim=s.gqa_head_dim, dtype=s.dtype,
        cache_elems_per_token=traffic["cache_elems_per_token"],
        kv_bytes=traffic["kv_bytes"], bytes=traffic["bytes"], flops=traffic["flops"],
        ms=ms, gbps=gbps, tflops=traffic["flops"] / (ms * 1e-3) / 1e12,
        copy_gbps=copy_gbps, bandwidth_fraction=gbps / copy_gbps if copy_gbps else None,
    )
    row.update(extra or {})
    row.update(env)
    return row


def _time_impl(impl, s, device, triton_kwargs, warmup, rep, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    l2 = _l2_bytes(device)
    if impl == "gqa_sdpa":
        traffic = gqa_traffic(s)
        make = _gqa_inputs
    else:
        traffic = mla_traffic(s)
        make = _mla_inputs
    sets = [make(s, device, gen) for _ in range(_n_sets(traffic["bytes"], l2))]
    fn = _make_fn(impl, s, sets, triton_kwargs, device)
    try:
        ms = _do_bench(fn, warmup, rep, device)
        ms_graph = _do_bench_graph(fn, rep, device)
    finally:
        del fn, sets
        _empty_cache(device)
    return ms, ms_graph, traffic


def bench_decode(
    shape: DecodeShape,
    *,
    impls=IMPLS,
    copy_gbps: float | None = None,
    triton_kwargs: dict | None = None,
    warmup: int = 25,
    rep: int = 100,
    seed: int = 0,
    dry_run: bool = False,
) -> list[dict]:
    """Time one decode step per implementation; one dict row each.

    Row keys: impl, the shape, bytes / kv_bytes / flops (per step), ms (median), gbps, tflops,
    copy_gbps (measured when not given), bandwidth_fraction = gbps / copy_gbps, ms_graph and
    bandwidth_fraction_graph (the same step replayed from a CUDA graph; None on the CPU), the GPU and
    versions, and time ratios: `x_vs_mla_triton` = this impl's time / the Triton kernel's time
    (how many times slower than the kernel); for mla_triton also its launch config.
    """
    device = require_cuda(dry_run)
    if "mla_triton" in impls:
        try:
            import triton  # noqa: F401
        except ImportError as exc:
            raise BenchUnavailable(f"triton is not importable: {exc}") from exc
    env = gpu_environment(device)
    if copy_gbps is None:
        copy_gbps = measure_copy_bandwidth(device)
    rows = []
    for impl in impls:
        ms, ms_graph, traffic = _time_impl(impl, shape, device, triton_kwargs, warmup, rep, seed)
        extra = {"ms_graph": ms_graph, "bandwidth_fraction_graph":
                 _gbps(traffic["bytes"], ms_graph) / copy_gbps if ms_graph and copy_gbps else None}
        if impl == "mla_triton":
            from transmla.mla.kernels.triton_decode import default_config

            cfg = default_config(shape.batch, shape.t_q * shape.heads, shape.context,
                                 shape.kv_lora_rank, shape.rope_dim, shape.torch_dtype, device)
            cfg.update(triton_kwargs or {})
            extra["config"] = cfg
        rows.append(_row(impl, shape, ms, traffic, copy_gbps, env, extra))
    base = next((r for r in rows if r["impl"] == "mla_triton"), None)
    if base is not None:
        for r in rows:
            r["x_vs_mla_triton"] = r["ms"] / base["ms"]
    return rows


def tune_mla_triton(
    shape: DecodeShape,
    *,
    copy_gbps: float | None = None,
    warmup: int = 10,
    rep: int = 50,
    split_candidates=(1, 2, 4, 8, 12, 16, 24, 32, 48, 64),
    dry_run: bool = False,
    max_configs: int | None = None,
    first_tiles: tuple[dict, ...] = (),
) -> tuple[dict, list[dict]]:
    """Small search over the kernel's launch parameters for one shape.

    Stage 1: tile configs (block_h, block_n, num_warps, num_stages) whose shared-memory estimate
    fits the device, `first_tiles` first, splits from the default heuristic. Stage 2: split counts
    with the best tile config. Under `max_configs`, stage 1 stops early enough that every split
    count of stage 2 is still timed (the split count is what a small batch needs most).
    Returns (best kwargs, all timed rows); configs that fail to compile are skipped.
    """
    import triton

    from transmla.mla.kernels.triton_decode import default_config, smem_estimate

    device = require_cuda(dry_run)
    env = gpu_environment(device)
    if copy_gbps is None:
        copy_gbps = measure_copy_bandwidth(device)
    s = shape
    rows_ = s.t_q * s.heads
    block_dc = max(16, triton.next_power_of_2(s.kv_lora_rank))
    block_dr = max(16, triton.next_power_of_2(s.rope_dim)) if s.rope_dim > 0 else 0
    smem_max = 227 * 1024
    if device.type == "cuda":
        from transmla.mla.kernels.triton_decode import _device_limits

        smem_max = _device_limits(device.index)[1]
    default = default_config(s.batch, rows_, s.context, s.kv_lora_rank, s.rope_dim, s.torch_dtype, device)

    gen = torch.Generator(device=device).manual_seed(0)
    traffic = mla_traffic(s)
    sets = [_mla_inputs(s, device, gen) for _ in range(_n_sets(traffic["bytes"], _l2_bytes(device)))]

    results: list[dict] = []

    def timed(kw: dict) -> float | None:
        if max_configs is not None and len(results) >= max_configs:
            return None
        fn = _make_fn("mla_triton", s, sets, kw, device)
        try:
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            # replayed from a CUDA graph where it can be: without one, launch and Python time hid the
            # kernel's differences below ~0.2 ms on the H200 (2026-11-28: split counts ranked at random)
            ms, timing = _do_bench_graph(fn, rep, device), "graph"
            if ms is None:
                ms, timing = _do_bench(fn, warmup, rep, device), "plain"
        except Exception as exc:  # out of resources, compilation failure
            results.append(dict(config=kw, error=f"{type(exc).__name__}: {str(exc)[:200]}"))
            return None
        results.append(_row("mla_triton", s, ms, traffic, copy_gbps, env, dict(config=dict(kw), timing=timing)))
        return ms

    block_hs = sorted({16, 32, min(64, max(16, triton.next_power_of_2(rows_)))})
    tiles = []
    for bh, bn, nw, st in itertools.product(block_hs, (32, 64), (4, 8), (2, 3, 4)):
        if smem_estimate(bh, bn, block_dc, block_dr, st, s.elem) <= smem_max:
            tiles.append(dict(block_h=bh, block_n=bn, num_warps=nw, num_stages=st))
    tiles = [t for t in first_tiles if t in tiles] + [t for t in tiles if t not in first_tiles]
    splits = [ns for ns in split_candidates if ns * 128 <= s.context]
    tile_limit = None if max_configs is None else max(1, max_configs - len(splits))
    best_kw, best_ms = dict(default), timed(dict(default))
    for t in tiles:
        if tile_limit is not None and len(results) >= tile_limit:
            break
        kw = dict(t, num_splits=default["num_splits"])
        if kw == default:
            continue
        ms = timed(kw)
        if ms is not None and (best_ms is None or ms < best_ms):
            best_kw, best_ms = kw, ms
    for ns in splits:
        if ns == best_kw["num_splits"]:
            continue
        kw = dict(best_kw, num_splits=ns)
        ms = timed(kw)
        if ms is not None and (best_ms is None or ms < best_ms):
            best_kw, best_ms = kw, ms
    del sets
    _empty_cache(device)
    for r in results:
        r["is_default"] = r.get("config") == default
        r["is_best"] = r.get("config") == best_kw
    return best_kw, results
