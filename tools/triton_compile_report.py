"""Ahead-of-time compile report of the Triton decode kernel, for machines without a GPU: what an
NVIDIA arch (sm_90 = H100) would get (shared memory, registers, spills, cp.async pipelining) from the
kernel of transmla/mla/kernels/triton_decode.py at a launch config. A developer tool, not part of the
runtime package (tests/test_triton_decode.py uses it; kernels/NOTES.md chose the launch configs with it).

    python tools/triton_compile_report.py [--d-c 512] [--d-r 64] [--block-h 32] ...   # prints JSON
"""

from __future__ import annotations

import os

import torch
import triton

from transmla.mla.kernels.triton_decode import INTERPRET, _mla_decode_split_kernel


def compile_report(
    *,
    d_c: int = 512,
    d_r: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    t_q: int | None = 1,
    block_h: int = 32,
    block_n: int = 32,
    num_warps: int = 8,
    num_stages: int = 4,
    num_splits: int = 2,
    has_seq_lens: bool = True,
    arch: int = 90,
) -> dict:
    """Compile the split kernel ahead of time for an NVIDIA arch (sm_90 = H100) without a GPU
    and report what the hardware would get: shared memory, registers, spill stack, and whether
    the loop loads were software-pipelined (cp.async). A development aid for CPU-only machines;
    uses triton internals (ASTSource, GPUTarget) and the bundled cuobjdump. Not available under
    TRITON_INTERPRET=1 (the kernel is then an interpreted function).

    Integer arguments are given the divisibility-by-16 specialisation the runtime applies to
    strides like 512 or 576; t_q=1 mirrors the runtime's specialisation of the value 1.
    """
    import subprocess

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if INTERPRET:
        raise RuntimeError("compile_report is unavailable under TRITON_INTERPRET=1")
    fn = _mla_decode_split_kernel
    names = fn.arg_names
    tname = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    const = dict(
        D_C=d_c, D_R=d_r, BLOCK_H=block_h, BLOCK_N=block_n,
        BLOCK_DC=max(16, triton.next_power_of_2(d_c)),
        BLOCK_DR=max(16, triton.next_power_of_2(max(d_r, 1))),
        NUM_SPLITS=num_splits, HAS_SEQ_LENS=has_seq_lens, UPCAST=False,
        INPUT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
    )
    if t_q == 1:
        const["T_Q"] = 1
    sig = {}
    for n in names:
        if n in const:
            sig[n] = "constexpr"
        elif n in ("Q_LAT", "Q_ROPE", "LATENT", "ROPE", "OUT"):
            sig[n] = "*" + tname
        elif n == "SEQ_LENS":
            sig[n] = "*i32"
        elif n in ("O_PART", "LSE_PART"):
            sig[n] = "*fp32"
        elif n == "qk_scale":
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n].startswith("*") or n.startswith("stride_")}
    kernel = triton.compile(
        ASTSource(fn, sig, constexprs=const, attrs=attrs),
        target=GPUTarget("cuda", arch, 32),
        options=dict(num_warps=num_warps, num_stages=num_stages),
    )
    ttgir = kernel.asm["ttgir"]
    report = dict(
        arch=arch, shared_bytes=int(kernel.metadata.shared),
        async_copies=ttgir.count("ttg.async_copy_global_to_local"),
        wgmma=ttgir.count("warp_group_dot"), registers=None, spill_stack_bytes=None,
    )
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if os.path.exists(tool):
        import tempfile

        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            usage = subprocess.run([tool, "--dump-resource-usage", f.name],
                                   capture_output=True, text=True).stdout
        for tok in " ".join(l for l in usage.splitlines() if "REG:" in l).split():
            if tok.startswith("REG:"):
                report["registers"] = int(tok[4:])
            elif tok.startswith("STACK:"):
                report["spill_stack_bytes"] = int(tok[6:])
    return report


__all__ = ["compile_report"]


def main(argv: list[str] | None = None) -> None:
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("d_c", "d_r", "block_h", "block_n", "num_warps", "num_stages", "num_splits", "arch"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=compile_report.__kwdefaults__[name])
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    args = vars(parser.parse_args(argv))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.pop("dtype")]
    print(json.dumps(compile_report(dtype=dtype, **args), indent=2))


if __name__ == "__main__":
    main()
