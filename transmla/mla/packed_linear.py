"""Linear layers with weights prepacked for oneDNN: the CPU's decode linears at memory speed.

A decode step multiplies a few rows (batch x 1 token) by every weight of the model, so it should
stream the weights at memory bandwidth. `F.linear` on the CPU does not for bf16, nor for fp32 at a
few rows: it repacks the weight into the GEMM's blocked layout on every call (kernels/NOTES.md
has the measurements). oneDNN's reorder (`torch.ops.mkldnn.
_reorder_linear_weight`, what Inductor's CPU freezing uses) packs a weight once; `_linear_pointwise`
then multiplies with it.

`PackedCPULinear` is an `nn.Linear` (same parameters, state dict and hooks) that takes this path
only where it pays and changes nothing else: CPU, no autograd (inference or `torch.no_grad`), bf16 at
any row count, fp32 from FP32_MIN_ROWS to FP32_MAX_ROWS rows (below, F.linear's matrix-vector
path already streams; above, the product is compute-bound and the packed call loses: the timings
behind those bounds are in kernels/NOTES.md). The pack is built on first use and again
whenever the weight changes (its storage, dtype or in-place version), so training, `.to()` and
`load_state_dict` need no care. It costs a second copy of each packed weight in memory, so it is
turned on only for decoding (the MLA model's `generate()`, `transmla bench generate`) and only when
the copy fits: the linears' weights must be under half of the memory available (MemAvailable).
oneDNN packs bf16 only on CPUs with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; on others (an AVX2-only
AMD EPYC, say) bf16 linears stay plain `F.linear` (`onednn_packs`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FP32_MAX_ROWS", "FP32_MIN_ROWS", "PackedCPULinear", "available_memory_bytes", "onednn_linear_available",
           "onednn_packs", "use_packed_linears"]

FP32_MIN_ROWS, FP32_MAX_ROWS = 4, 16  # the fp32 row counts where packing measured faster


def onednn_linear_available() -> bool:
    """Whether this torch build has oneDNN's prepacked linear ops (x86 CPU wheels do)."""
    ops = getattr(torch.ops, "mkldnn", None)
    return bool(torch.backends.mkldnn.is_available() and ops is not None
                and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise"))


@functools.lru_cache(maxsize=None)
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN prepacks a weight of this dtype on this CPU: tried once on a small weight
    (bf16 raises on a CPU without AVX-512 BW/VL/DQ or AVX-NE-CONVERT)."""
    if dtype not in (torch.float32, torch.bfloat16) or not onednn_linear_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), FP32_MAX_ROWS)
    except RuntimeError:
        return False
    return True


class PackedCPULinear(nn.Linear):
    """nn.Linear whose no-grad CPU calls use a oneDNN-prepacked weight where that is faster."""

    packed_enabled: bool = True
    _pack: torch.Tensor | None = None
    _pack_key: tuple | None = None

    def _wants_pack(self, x: torch.Tensor) -> bool:
        w = self.weight
        if not self.packed_enabled or x.device.type != "cpu" or x.dtype != w.dtype:
            return False
        if torch.is_grad_enabled() and (w.requires_grad or x.requires_grad):
            return False
        if w.dtype == torch.bfloat16:
            return onednn_packs(torch.bfloat16)
        return w.dtype == torch.float32 and FP32_MIN_ROWS <= x.numel() // max(x.shape[-1], 1) <= FP32_MAX_ROWS

    def _packed(self) -> torch.Tensor:
        w = self.weight
        key = (w.data_ptr(), w.dtype, w._version, tuple(w.shape))
        if self._pack_key != key:
            with torch.no_grad():
                self._pack = torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), FP32_MAX_ROWS)
            self._pack_key = key
        return self._pack

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._wants_pack(x):
            return torch.ops.mkldnn._linear_pointwise(x, self._packed(), self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def use_packed_linears(model: nn.Module, enabled: bool = True) -> int:
    """Make every plain nn.Linear of `model` a PackedCPULinear (in place: same parameters) and set
    whether they pack; the number that will pack (0 when disabled, without oneDNN's ops, when oneDNN
    cannot pack the weights' dtype on this CPU, or when the packed copies would not fit in half the
    available memory). Records the outcome as `model.packed_linears`."""
    linears = []
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = PackedCPULinear
        if isinstance(module, PackedCPULinear):
            linears.append(module)
    if enabled:
        weights = sum(m.weight.numel() * m.weight.element_size() for m in {id(m.weight): m for m in linears}.values())
        free = available_memory_bytes()
        dtypes = {m.weight.dtype for m in linears}
        enabled = all(onednn_packs(d) for d in dtypes) and (free is None or weights < free // 2)
    for module in linears:
        module.packed_enabled = enabled
        module._pack = module._pack_key = None  # a disabled module keeps no second copy
    model.packed_linears = enabled
    return len(linears) if enabled else 0
