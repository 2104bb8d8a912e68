"""The public TransMLA code (fxmeng/TransMLA) converting a model, run inside its own virtual environment
(transformers 4.52.4, its requirements' pin): started by benchmarks/public_transmla.py, never imported by it.
It imports nothing of transmla (that needs transformers 5): the driver hands over token windows and calibration
paragraphs in a torch file, and this script hands back perplexities in a JSON file.

    PY public_transmla_worker.py --checkout DIR --source MODEL_DIR --data DATA.pt --rank R --rope r --freqfold F
                                 --samples N --out OUT.json [--carry-layer-type]

The conversion is the public converter's main() without its saving: partial_rope (RoRoPE, FreqFold F, collapse =
head_dim / r) then low_rank_qkv (BKV-PCA to kv_lora_rank R), every other setting its argparse default (fp32 on
the CPU; its calibration loader over our paragraphs instead of wikitext2, which cannot be downloaded here).
--carry-layer-type copies each replaced attention's `is_sliding` and `sliding_window` onto the module that replaces
it (Gemma 2/3 decoder layers read them from self_attn); without it the code runs exactly as published.
Perplexity: token-level exp(mean NLL) over the given windows, every token but each window's first scored (what
`transmla eval` scores), in fp32; scored for the source, after low_rank_qkv and (with --carry-layer-type)
after partial_rope. A stage that raises is recorded (its error and where) and ends the run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F


def _load_stand_in():
    """benchmarks/peer_datasets.py by its path (its package imports transmla)."""
    spec = importlib.util.spec_from_file_location("peer_datasets", Path(__file__).with_name("peer_datasets.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.datasets_stand_in()
    return module.Rows


@torch.no_grad()
def perplexities(model, windows: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per text: exp(mean NLL) of tokens 1.. of each [W, T] window, log-softmax in fp32, sums in float64."""
    model.eval()
    out = {}
    for text, ids in windows.items():
        nll, scored = 0.0, 0
        for w in range(ids.shape[0]):
            x = ids[w : w + 1]  # [1, T]
            logits = model(input_ids=x, use_cache=False).logits  # [1, T, V]
            logp = F.log_softmax(logits[:, :-1].float(), dim=-1)  # [1, T-1, V]
            nll -= logp.gather(-1, x[:, 1:, None]).double().sum().item()
            scored += x.shape[1] - 1
        out[text] = math.exp(nll / scored)
    return out


def carry_layer_type(*classes) -> None:
    """Each class's __init__(self, self_attn, ...) also copies self_attn's is_sliding and sliding_window."""
    for cls in classes:
        init = cls.__init__

        def __init__(self, self_attn, *args, _init=init, **kwargs):
            _init(self, self_attn, *args, **kwargs)
            for name in ("is_sliding", "sliding_window"):
                if hasattr(self_attn, name):
                    setattr(self, name, getattr(self_attn, name))

        cls.__init__ = __init__


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkout", type=Path, required=True)
    ap.add_argument("--source", type=Path, required=True)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--rope", type=int, required=True)
    ap.add_argument("--freqfold", type=int, required=True)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--carry-layer-type", action="store_true")
    args = ap.parse_args()

    import transformers  # noqa: F401  (first: it looks for an installed `datasets` when imported)

    Rows = _load_stand_in()
    sys.path.insert(0, str(args.checkout / "transmla" / "transmla"))
    from lora_qkv import LoraQKV, low_rank_qkv
    from partial_rope import PartialRope, partial_rope
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from utils import prepare_dataloader

    if args.carry_layer_type:
        carry_layer_type(PartialRope, LoraQKV)
    data = torch.load(args.data)
    windows = data["windows"]
    model = AutoModelForCausalLM.from_pretrained(args.source, torch_dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    tok = AutoTokenizer.from_pretrained(args.source)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    head_dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    # converter.py's argparse defaults, but the shape, fp32 and the CPU
    kwargs = dict(model_path=str(args.source), save_path="-", dtype="fp32", device="cpu", cal_dataset="wikitext2",
                  cal_nsamples=args.samples, cal_batch_size=8, cal_max_seqlen=256, seed=42, ppl_eval_batch_size=0,
                  freqfold=args.freqfold, collapse=head_dim // args.rope, qk_mqa_dim=args.rope, q_lora_rank=None,
                  kv_lora_rank=args.rank, balance_kv_ratio=1.0, use_qkv_norm=False, deepseek_style=False)
    result: dict = {"settings": {k: v for k, v in kwargs.items() if k not in ("model_path", "save_path")},
                    "carry_layer_type": args.carry_layer_type, "model_type": model.config.model_type,
                    "qk_norm": hasattr(model.model.layers[0].self_attn, "k_norm"),
                    "transformers": __import__("transformers").__version__, "torch": torch.__version__}

    def save() -> None:
        args.out.write_text(json.dumps(result, indent=1))

    def stage(name: str, step) -> bool:
        start = time.perf_counter()
        try:
            step()
        except Exception as exc:  # the published code failing is a result, not a crash of the benchmark
            # where: the deepest frame outside torch (torch's Module.__getattr__ raises for a missing attribute)
            frame = [f for f in traceback.extract_tb(exc.__traceback__) if "/torch/" not in f.filename][-1]
            result["failed"] = {"stage": name, "error": f"{type(exc).__name__}: {exc}",
                                "where": f"{'/'.join(Path(frame.filename).parts[-2:])}:{frame.lineno} ({frame.line})"}
            save()
            return False
        result.setdefault("seconds", {})[name] = round(time.perf_counter() - start, 1)
        save()
        return True

    state = {"model": model}
    paragraphs = data["paragraphs"]

    def source():
        result["source"] = perplexities(state["model"], windows)

    def rope():
        train = prepare_dataloader(dataset=Rows.from_dict({"text": paragraphs}), tokenizer=tok, max_seqlen=256,
                                   batch_size=8, nsamples=args.samples, seed=42)
        state["train"] = train
        with torch.no_grad():
            state["model"] = partial_rope(state["model"], tok, train, None, **kwargs)
        if args.carry_layer_type:  # as published, the next forward is low_rank_qkv's calibration
            result["partial_rope"] = perplexities(state["model"], windows)

    def lowrank():
        with torch.no_grad():
            state["model"] = low_rank_qkv(state["model"], tok, state["train"], None, **kwargs)
        result["final"] = perplexities(state["model"], windows)
        attn = state["model"].model.layers[0].self_attn
        result["kept_modules"] = sorted(n for n, _ in attn.named_children())

    for name, step in (("source", source), ("partial_rope", rope), ("low_rank_qkv", lowrank)):
        if not stage(name, step):
            break
    save()


if __name__ == "__main__":
    main()
