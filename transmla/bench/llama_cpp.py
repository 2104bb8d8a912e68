"""Running the llama.cpp that `make llama-cpp` builds (tools/llama_cpp/build.sh): logits, the KV
cache it reports, tokenization, perplexity and llama-bench, each through its own binary. The same
for ik_llama.cpp (`make ik-llama-cpp`, tools/ik_llama_cpp/build.sh): pass build=IK."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

@dataclass(frozen=True)
class LlamaBuild:
    """One llama.cpp build: its name, the sdist version it is built from, the variable that moves it
    and the make target that builds it."""

    name: str
    version: str
    env: str
    make_target: str


MAINLINE = LlamaBuild("llama.cpp", "0.3.36", "LLAMA_CPP_DIR", "llama-cpp")  # llama-cpp-python's vendored llama.cpp
IK = LlamaBuild("ik_llama.cpp", "0.1.5", "IK_LLAMA_CPP_DIR", "ik-llama-cpp")  # ik-llama-cpp-python's


class LlamaCppMissing(RuntimeError):
    """The llama.cpp build is not there."""


def llama_cpp_dir(build: LlamaBuild = MAINLINE) -> Path:
    """$LLAMA_CPP_DIR (IK: $IK_LLAMA_CPP_DIR), else ~/.cache/transmla/<name>-<version> (outside every work tree)."""
    default = Path.home() / ".cache" / "transmla" / f"{build.name}-{build.version}"
    return Path(os.environ.get(build.env, default))


def applied_patches(build: LlamaBuild = IK) -> set[str]:
    """The names of the patches its build script applied to that build's source (tools/ik_llama_cpp/build.sh's
    IK_PATCHES, listed in <dir>/transmla-patches); empty for the engine as its users get it."""
    listed = llama_cpp_dir(build) / "transmla-patches"
    return set(listed.read_text().split()) if listed.is_file() else set()


def llama_cpp_tool(name: str, build: LlamaBuild = MAINLINE) -> Path:
    path = llama_cpp_dir(build) / "build" / "bin" / name
    if not path.is_file():
        raise LlamaCppMissing(f"{name} not found in {path.parent}; build it with `make {build.make_target}`")
    return path


def _run(args: list[str | Path], **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"{Path(str(args[0])).name} failed ({proc.returncode}): {tail}")
    return proc


@dataclass
class KVCacheReport:
    """llama.cpp's own line: `llama_kv_cache: size = ... MiB (N cells, L layers, ...), K (t): ..., V (t): ...`."""

    mib: float
    cells: int
    layers: int
    k_type: str
    k_mib: float
    v_type: str
    v_mib: float


_KV_LINE = re.compile(
    r"llama_kv_cache: size = +([\d.]+) MiB \( *(\d+) cells, +(\d+) layers.*?\), "
    r"K \((\w+)\): +([\d.]+) MiB, V \((\w+)\): +([\d.]+) MiB"
)


def kv_cache_report(log: str) -> KVCacheReport:
    match = _KV_LINE.search(log)
    if match is None:
        raise ValueError("no llama_kv_cache size line in llama.cpp's log")
    mib, cells, layers, k_type, k_mib, v_type, v_mib = match.groups()
    return KVCacheReport(float(mib), int(cells), int(layers), k_type, float(k_mib), v_type, float(v_mib))


def llama_logits(gguf_path: str | Path, tokens: list[int], mode: str = "prefill", n_ctx: int = 256,
                 build: LlamaBuild = MAINLINE, mla: int = 3, flash_attn: bool = True,
                 cache_type: str = "f16") -> tuple[np.ndarray, str]:
    """Logits [len(tokens), vocab] from llama.cpp (one thread) and its log (stdout and stderr).

    prefill: one batch; decode: one token per llama_decode call (the cached path); parallel: two
    sequences of these tokens, their prompts (all but the last 8 tokens) decoded one after the other,
    then their last 8 tokens together (parallel decode): logits [2, len(tokens), vocab]. Mainline: no
    flash attention, an f32 KV cache. build=IK: ik_llama.cpp's MLA mode `mla`, flash attention and KV
    cache type (f16, bf16, q8_0, f32, or "K,V"; on the CPU ik takes no f32 cache with flash attention
    and no V cache but f16/bf16 without it)."""
    modes = [mla, int(flash_attn), cache_type] if build == IK else []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "logits.bin"
        proc = _run([llama_cpp_tool("transmla-logits", build), gguf_path, out, mode, n_ctx, *modes, *tokens])
        logits = np.fromfile(out, dtype=np.float32)
    shape = (2, len(tokens), -1) if mode == "parallel" else (len(tokens), -1)
    return logits.reshape(shape), proc.stdout + proc.stderr


@dataclass
class IKKVCacheReport:
    """ik_llama.cpp's MLA line: `KV self size = ... MiB, c^KV (t): ... MiB, kv^T (t): ... MiB` (kv^T: the
    transposed latent that -mla 1 without flash attention keeps, else `not used`), and its n_ctx."""

    mib: float
    cells: int
    type: str
    c_mib: float  # [k_rope; c] per token per layer
    kv_t_mib: float  # 0 when not used


_IK_KV_LINE = re.compile(r"KV self size += +([\d.]+) MiB, c\^KV \((\w+)\): +([\d.]+) MiB, kv\^T(?: \((\w+)\): +([\d.]+) MiB|: not used)")
_IK_N_CTX = re.compile(r"llama_init_from_model: n_ctx += (\d+)")


def ik_kv_cache_report(log: str) -> IKKVCacheReport:
    match, n_ctx = _IK_KV_LINE.search(log), _IK_N_CTX.search(log)
    if match is None or n_ctx is None:
        raise ValueError("no MLA `KV self size` line or n_ctx in ik_llama.cpp's log")
    mib, kv_type, c_mib, _, kv_t_mib = match.groups()
    return IKKVCacheReport(float(mib), int(n_ctx.group(1)), kv_type, float(c_mib), float(kv_t_mib or 0))


_IK_BUFFERS = {  # what ik_llama.cpp's loader and context print (MiB)
    "weights": re.compile(r"llm_load_tensors: +CPU buffer size = +([\d.]+) MiB"),
    "kv": re.compile(r"KV self size += +([\d.]+) MiB"),
    "output": re.compile(r"CPU +output buffer size = +([\d.]+) MiB"),
    "compute": re.compile(r"CPU compute buffer size = +([\d.]+) MiB"),
}


def ik_memory(gguf_path: str | Path, n_ctx: int, mla: int = 3, flash_attn: bool = True, cache_type: str = "f16",
              threads: int = 1) -> dict:
    """What ik_llama.cpp allocates for a context of n_ctx cells (shared by all sequences): its own buffer
    sizes in MiB (weights, kv, output, compute and their total) and the process's peak RSS in MiB. The
    vehicle is llama-perplexity: it loads the model and creates the context (the KV cache cleared, so
    touched), then stops on a text too short to score (exit 1; any other failure raises). The RSS comes
    from /usr/bin/time, whose child is forked from it: a child forked from this Python process would
    count this process's RSS at the fork as its own peak (Linux keeps a process's peak across exec)."""
    args = [llama_cpp_tool("llama-perplexity", IK), "-m", gguf_path, "-c", n_ctx, "-t", threads, "-mla", mla,
            "-fa", int(flash_attn), "-ctk", cache_type, "-ctv", cache_type]
    with tempfile.TemporaryDirectory() as tmp:
        text, peak = Path(tmp) / "short.txt", Path(tmp) / "peak"
        text.write_text("A text far too short to score.\n")
        proc = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", str(peak), *(str(a) for a in (*args, "-f", text))],
                              capture_output=True, text=True, cwd=tmp)
        out = proc.stdout + proc.stderr
        rss_kib = int(peak.read_text().split()[-1]) if peak.exists() else 0
    sizes = {}
    for name, pattern in _IK_BUFFERS.items():
        found = pattern.findall(out)
        if not found:
            tail = "\n".join(out.strip().splitlines()[-5:])
            raise RuntimeError(f"llama-perplexity printed no {name} buffer size (exit {proc.returncode}): {tail}")
        sizes[name] = sum(float(x) for x in found)
    made = _IK_N_CTX.search(out)
    if "you need at least" not in out or made is None:
        raise RuntimeError(f"llama-perplexity did not stop where expected (exit {proc.returncode})")
    # n_ctx: the cells ik made (it may round the request up)
    return {**sizes, "total": sum(sizes.values()), "rss": rss_kib / 1024, "n_ctx": int(made.group(1))}


def llama_tokenize(gguf_path: str | Path, text: str) -> list[int]:
    """Token ids llama.cpp gives `text` with this GGUF's vocabulary (adding BOS only if it says so)."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        proc = _run([llama_cpp_tool("llama-tokenize"), "-m", gguf_path, "-f", f.name, "--ids", "--log-disable"])
    return json.loads(proc.stdout.strip().splitlines()[-1])


_FINAL_PPL = re.compile(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)")


def llama_perplexity(gguf_path: str | Path, text_path: str | Path, n_ctx: int, chunks: int, threads: int = 2) -> tuple[float, str]:
    """llama-perplexity's final estimate over the first `chunks` windows of `n_ctx` tokens (llama.cpp
    scores the second half of each window), and its log."""
    proc = _run([llama_cpp_tool("llama-perplexity"), "-m", gguf_path, "-f", text_path, "-c", n_ctx, "-b", n_ctx,
                 "--chunks", chunks, "-t", threads])
    match = _FINAL_PPL.search(proc.stdout + proc.stderr)
    if match is None:
        raise RuntimeError("llama-perplexity printed no final estimate")
    return float(match.group(1)), proc.stderr


def llama_bench(gguf_paths: list[str | Path], depths: list[int], n_gen: int, reps: int, threads: int = 2,
                flash_attn: bool = True) -> list[dict]:
    """llama-bench decode rows (`-p 0 -n n_gen -d depths`), one JSON record per model and depth
    (samples_ts: tokens/s of each repetition). Flash attention is on by default: without it llama.cpp
    copies the transposed latent cache of an MLA model in every layer at every step (its `v_cont`)."""
    args: list[str | Path] = [llama_cpp_tool("llama-bench")]
    for path in gguf_paths:
        args += ["-m", path]
    args += ["-p", "0", "-n", n_gen, "-d", ",".join(map(str, depths)), "-r", reps, "-t", threads,
             "-fa", "on" if flash_attn else "off", "-o", "json"]
    return json.loads(_run(args).stdout)


def ik_llama_bench(gguf_path: str | Path, depths: list[int], n_gen: int, reps: int, threads: int, mla: int = 3,
                   flash_attn: bool = True, cache_type: str = "f16", n_prompt: int = 0) -> list[dict]:
    """ik_llama.cpp's llama-bench: decode after a prompt of each depth (`-gp DEPTH,n_gen`; depth 0 is
    `-n n_gen`) and, with n_prompt, prompt speed (`-p`), in MLA mode `mla`, one JSON record per row:
    n_depth, n_prompt, n_gen and samples_ts (tokens/s of each repetition)."""
    args: list[str | Path] = [llama_cpp_tool("llama-bench", IK), "-m", gguf_path, "-p", n_prompt, "-n", 0,
                              "-r", reps, "-t", threads, "-mla", mla, "-fa", int(flash_attn),
                              "-ctk", cache_type, "-ctv", cache_type, "-o", "json"]
    for depth in depths:
        args += ["-n", n_gen] if depth == 0 else ["-gp", f"{depth},{n_gen}"]
    stdout = _run(args).stdout  # ik also printf()s a few notes of its loader there
    rows = []
    for row in json.loads("\n".join(line for line in stdout.splitlines() if not line.startswith("="))):
        if row["n_gen"] == 0 and row["n_prompt"] == 0:
            continue
        gp = row["n_gen"] > 0 and row["n_prompt"] > 0  # -gp: the prompt's tokens are not counted in the rate
        tokens = row["n_gen"] if gp or row["n_prompt"] == 0 else row["n_prompt"]
        rows.append({"n_depth": row["n_prompt"] if gp else 0, "n_prompt": 0 if gp else row["n_prompt"],
                     "n_gen": row["n_gen"], "samples_ts": [1e9 * tokens / ns for ns in row["samples_ns"]],
                     "mla_attn": mla, "flash_attn": flash_attn, "type_k": row.get("type_k")})
    return rows


_BATCHED_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|"
                          r"\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|", re.M)


def ik_batched_bench(gguf_path: str | Path, depth: int, n_gen: int, parallel: list[int], threads: int, mla: int = 3,
                     flash_attn: bool = True, cache_type: str = "f16") -> list[dict]:
    """ik_llama.cpp's llama-batched-bench: `parallel` sequences, each with its own prompt of `depth`
    tokens, then n_gen tokens each decoded together; one record per sequence count (S_TG: decode tokens/s
    summed over the sequences), one run each. prompt_layout: how the build lays out the prompts' cells
    ("interleaved" position by position across the sequences, as ik ships it; "contiguous" one sequence after
    another, as llama-server does: contiguous-prompts.patch). On a build with op-timing.patch each record also
    has decode_ops: thread 0's microseconds per decode step by graph node name (`op_timing`)."""
    patches = applied_patches(IK)
    env = os.environ | {"TRANSMLA_OP_TIMING": "1"} if "op-timing" in patches else None
    records = []
    for sequences in parallel:
        with tempfile.TemporaryDirectory() as tmp:  # it writes llama.log into its working directory
            proc = _run([llama_cpp_tool("llama-batched-bench", IK), "-m", Path(gguf_path).resolve(),
                         "-c", sequences * (depth + n_gen), "-b", 2048, "-ub", 512, "-npp", depth, "-ntg", n_gen,
                         "-npl", sequences, "-t", threads, "-mla", mla, "-fa", int(flash_attn), "-ctk", cache_type,
                         "-ctv", cache_type], cwd=tmp, env=env)
        ops = op_timing(proc.stderr) if env else {}
        records += [{"depth": int(pp), "n_gen": int(tg), "sequences": int(b), "n_kv": int(kv), "prompt_s": float(t_pp),
                     "prompt_tps": float(s_pp), "decode_s": float(t_tg), "decode_tps": float(s_tg), "mla_attn": mla,
                     "flash_attn": flash_attn,
                     "prompt_layout": "contiguous" if "contiguous-prompts" in patches else "interleaved"}
                    | ({"decode_ops": ops} if ops else {})
                    for pp, tg, b, kv, t_pp, s_pp, t_tg, s_tg in _BATCHED_ROW.findall(proc.stdout + proc.stderr)]
    return records


_OP_GRAPHS = re.compile(r"^transmla-op-timing: (\d+) decode graphs, ([\d.]+) us each$", re.M)
_OP_ROW = re.compile(r"^transmla-op-timing: (.+?)\s+([\d.]+) us/graph\s+\d+ nodes$", re.M)


def op_timing(log: str) -> dict:
    """op-timing.patch's report (TRANSMLA_OP_TIMING=1): {"graphs": n, "step_us": mean microseconds per decode
    step, "ops": {"OP:name": microseconds per step}} over the graphs of at most 16 tokens, the names' layer
    suffix dropped; nodes under 1% of a step are summed as "other"."""
    head = _OP_GRAPHS.search(log)
    if head is None:
        return {}
    step = float(head.group(2))
    ops: dict[str, float] = {}
    for name, us in _OP_ROW.findall(log):
        key = name if float(us) >= 0.01 * step else "other"
        ops[key] = round(ops.get(key, 0.0) + float(us), 1)
    return {"graphs": int(head.group(1)), "step_us": step, "ops": ops}
