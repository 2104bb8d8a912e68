"""The built-in SmolLM2-135M as the TransMLA benchmarks see it: its texts and windows, calibration
statistics cached on disk, conversions through the method API, and perplexity on the dev and test
windows. Shared by transmla_bench, mha2mla_calib_shape and deepseek_export_bench.

Windows (512 tokens, non-overlapping):
- final: wiki-test (the first 64 windows of the built-in wiki evaluation part; the first 32 are the
  ANCHORS.md protocol) and lee-test (all 29 windows of the lee evaluation part);
- dev32: 16 windows from the END of the wiki calibration part and the first 16 of the lee
  calibration part (lee is never calibrated on);
- dev (history): 8 windows from the end of the wiki calibration part;
- lee-64: the 64 lee windows after the dev32 ones.
Statistics, converted layers and every perplexity are cached under $TRANSMLA_CACHE/bench-transmla.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import fields, replace

import torch
from safetensors.torch import load_file, save_file

from transmla.checkpoint.resolve import cache_root, load_config, resolve_model_dir
from transmla.convert.assemble import assemble_model
from transmla.convert.calibrate import LayerStats, calibrated_layers, collect_layer_stats
from transmla.convert.layers import MLALayer, source_layers
from transmla.convert.options import CalibrationOptions, ConvertOptions
from transmla.convert.pipeline import LayerStream
from transmla.convert.registry import get_method
from transmla.convert.transmla.method import TransMLAPlan, convert_layer, default_plan, published_plan
from transmla.data.calib import calibration_chunks
from transmla.data.texts import load_text
from transmla.eval.perplexity import perplexity, tokenize_text

from .common import ResultCache, log

CACHE = cache_root() / "bench-transmla"
MODEL = "smollm2-135m"
SEQ = 512
BUDGETS = {"50%": (128, 64, 2), "25%": (64, 32, 4), "12.5%": (32, 16, 4)}  # R, r, published freqfold
PUBLISHED_CALIB = (128, 256, 42)
DEV_WINDOWS = 16  # per text in the dev32 set


def dev32_ppl(model, windows: dict[str, torch.Tensor]) -> dict:
    """Perplexity on the dev32 windows ({text: ids}): each text ("wiki", "lee") and both together
    ("ppl", pooled NLL)."""
    res = {name: perplexity(model, ids, SEQ, progress=False) for name, ids in windows.items()}
    pooled = sum(r.nll * r.tokens for r in res.values()) / sum(r.tokens for r in res.values())
    return {"ppl": math.exp(pooled), **{name: r.perplexity for name, r in res.items()}}


class Bench:
    def __init__(self) -> None:
        CACHE.mkdir(parents=True, exist_ok=True)
        self.src_dir = resolve_model_dir(MODEL)
        self.config = load_config(self.src_dir)
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(self.src_dir))
        self.sources = list(source_layers(self.src_dir, self.config))
        self.cache = ResultCache(CACHE / "results.json")  # several bench processes may share it
        self.results, self.cached, self.save = self.cache.results, self.cache.cached, self.cache.save
        wiki_calib = tokenize_text(self.tok, load_text("wiki", "calib"))
        self.dev_ids = wiki_calib[-8 * SEQ :]  # [4096]
        lee_calib = tokenize_text(self.tok, load_text("lee", "calib"))
        # dev32: 16 windows from the end of the wiki calibration part and the first 16 of the lee
        # calibration part (never used for calibration: the calibration text is wiki).
        self.dev32_ids = {"wiki": wiki_calib[-DEV_WINDOWS * SEQ :], "lee": lee_calib[: DEV_WINDOWS * SEQ]}
        # lee-64: the 64 lee windows after the dev ones (the lee evaluation part has only 29; no
        # lee text is ever calibrated on, and these were not looked at while choosing).
        self.lee64_ids = lee_calib[DEV_WINDOWS * SEQ : (DEV_WINDOWS + 64) * SEQ]
        self.wiki = tokenize_text(self.tok, load_text("wiki", "eval"))
        self.lee = tokenize_text(self.tok, load_text("lee", "eval"))

    # -- calibration ---------------------------------------------------------------------------
    def calib_ids(self, n: int, t: int, seed: int) -> torch.Tensor:
        return calibration_chunks(self.tok, "wiki", n, t, seed)

    def dev_overlap(self, ids: torch.Tensor) -> int:
        """Calibration chunks that also appear in the dev windows (found by content)."""
        dev = self.dev_ids.tolist()
        dev_str = ",".join(map(str, dev))
        return sum(",".join(map(str, row[:16].tolist())) in dev_str for row in ids)

    def original_grams(self, n: int, t: int, seed: int) -> list[torch.Tensor]:
        """Every layer's gram under original propagation (collect_layer_stats), cached on disk."""
        path = CACHE / f"grams_original_{n}x{t}_s{seed}.pt"
        if not path.exists():
            log(f"collecting original-propagation statistics {n} x {t} (seed {seed})")
            start = time.perf_counter()
            stats = collect_layer_stats(self.src_dir, self.config, self.calib_ids(n, t, seed), progress=False)
            torch.save({"grams": [s.gram for s in stats], "seconds": time.perf_counter() - start}, path)
        return torch.load(path, weights_only=True)["grams"]

    def original_stats(self, n: int, t: int, seed: int) -> list[LayerStats]:
        """Every layer's statistics under original propagation (the cached grams; no pair norms)."""
        return [LayerStats(gram=g, tokens=n * t) for g in self.original_grams(n, t, seed)]

    def published_pca_grams(self, budget: str) -> list[torch.Tensor]:
        """The published second stage: grams of the partial-RoPE model (every layer after RoRoPE and
        FreqFold, at full rank), the RoRoPE step itself calibrated on the original model."""
        R, r, fold = BUDGETS[budget]
        n, t, seed = PUBLISHED_CALIB
        path = CACHE / f"grams_published_stage2_{budget[:-1]}_{n}x{t}_s{seed}.pt"
        if not path.exists():
            rope_grams = self.original_grams(n, t, seed)
            plan = replace(published_plan(R, r, fold), kv_lora_rank=2 * 192 - r)  # full rank: partial RoPE
            grams: list[torch.Tensor] = []

            def partial(i, src, stats):
                grams.append(stats.gram)
                # Not the method API on purpose (see layers_published): RoRoPE on the original model's gram.
                return convert_layer(src, rope_grams[i], plan)[0]

            log(f"collecting published stage-2 statistics ({budget})")
            for _ in calibrated_layers(self.src_dir, self.config, self.calib_ids(n, t, seed), partial,
                                       propagate="converted", progress=False):
                pass
            torch.save({"grams": grams}, path)
        return torch.load(path, weights_only=True)["grams"]

    # -- conversions ---------------------------------------------------------------------------
    def layers_original(self, plan: TransMLAPlan, stats: list[LayerStats]):
        """Every layer converted by the transmla method with `plan` on precomputed statistics
        (original propagation): (layers, infos)."""
        method = get_method("transmla")
        converted = [method.convert_layer(plan, src, st) for src, st in zip(self.sources, stats)]
        return [layer for layer, _ in converted], [info for _, info in converted]

    def layers_published(self, plan: TransMLAPlan, grams, rope_grams):
        """The published two-stage TransMLA, which the method deliberately does not offer: RoRoPE
        calibrated on the original model (rope_grams), BKV-PCA on the partial-RoPE model (grams,
        published_pca_grams). Hence the module function convert_layer with its rope_gram argument."""
        out, infos = [], []
        for src, gram, rope_gram in zip(self.sources, grams, rope_grams):
            layer, info = convert_layer(src, gram, plan, rope_gram=rope_gram)
            out.append(layer)
            infos.append(info)
        return out, infos

    def layers_converted(self, plan: TransMLAPlan, ids: torch.Tensor):
        """Every layer converted by the transmla method, later layers calibrated on the converted
        earlier ones (the pipeline's LayerStream on these calibration tokens): (layers, infos)."""
        options = ConvertOptions("transmla", calibration=CalibrationOptions(propagate="converted", device="cpu"))
        stream = LayerStream(get_method("transmla"), self.src_dir, self.config, options, progress=False,
                             calib_ids=ids, plan=plan)
        layers = list(stream)
        return layers, stream.infos

    def source_model(self):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(str(self.src_dir), dtype=torch.float32).eval()

    def model(self, layers):
        return assemble_model(self.src_dir, self.config, layers, {"name": "transmla-bench"})

    # -- perplexity ----------------------------------------------------------------------------
    def dev_ppl(self, model) -> float:
        return perplexity(model, self.dev_ids, SEQ, progress=False).perplexity

    def dev32_ppl(self, model) -> dict:
        return dev32_ppl(model, self.dev32_ids)

    def final_ppl(self, model) -> dict:
        a = perplexity(model, self.wiki[: 32 * SEQ], SEQ, max_windows=32, progress=False)
        b = perplexity(model, self.wiki[32 * SEQ : 64 * SEQ], SEQ, max_windows=32, progress=False)
        lee = perplexity(model, self.lee, SEQ, progress=False)
        wiki64 = math.exp((a.nll * a.tokens + b.nll * b.tokens) / (a.tokens + b.tokens))
        return {"wiki_test_64": wiki64, "wiki_test_32": a.perplexity, "lee_test": lee.perplexity,
                "lee_windows": lee.windows, "wiki_tokens": a.tokens + b.tokens, "lee_tokens": lee.tokens}


def summarize_infos(infos) -> dict:
    folds = [i["freqfold"] for i in infos]
    return {
        "freqfold_per_layer": folds,
        "mean_logit_error": sum(i["logit_error"] for i in infos) / len(infos),
        "mean_pca_energy_kept": sum(i["pca_energy_kept"] for i in infos) / len(infos),
    }



def ours_plan(budget: str, **overrides) -> TransMLAPlan:
    R, r, _ = BUDGETS[budget]
    return replace(default_plan(R, r), **overrides)


def layers_cached(b: Bench, key: str, build):
    """Converted layers kept on disk (a converted-propagation pass is the expensive part): tensors in
    safetensors, the per-layer infos in JSON, so reading the cache never unpickles anything."""
    stem = CACHE / f"layers_{key.replace('/', '_').replace('%', 'pct')}"
    tensors_path, infos_path = stem.with_suffix(".safetensors"), stem.with_suffix(".json")
    if tensors_path.exists() and infos_path.exists():
        tensors = load_file(str(tensors_path))
        infos = json.loads(infos_path.read_text())["infos"]
        layers = [MLALayer(**{f.name: tensors.get(f"{i}.{f.name}") for f in fields(MLALayer)}) for i in range(len(infos))]
        return layers, infos
    start = time.perf_counter()
    layers, infos = build()
    flat = {f"{i}.{k}": v.contiguous() for i, layer in enumerate(layers) for k, v in layer.__dict__.items() if v is not None}
    save_file(flat, str(tensors_path))
    infos_path.write_text(json.dumps({"infos": infos, "seconds": time.perf_counter() - start}, default=float))
    return layers, infos


def ours_layers(b: Bench, budget: str, calib: tuple[int, int, int], propagate: str, **overrides):
    plan = ours_plan(budget, **overrides)
    tag = hashlib.sha1(json.dumps(plan.to_dict(), sort_keys=True).encode()).hexdigest()[:8]  # cached layers follow the plan
    key = f"{budget}_{calib[0]}x{calib[1]}_s{calib[2]}_{propagate}_{tag}"
    if propagate == "original":
        return layers_cached(b, key, lambda: b.layers_original(plan, b.original_stats(*calib)))
    return layers_cached(b, key, lambda: b.layers_converted(plan, b.calib_ids(*calib)))


def cli_defaults() -> tuple[tuple[int, int, int], str]:
    """The calibration (samples, tokens, seed) and propagation `transmla convert` uses by default."""
    method, o = get_method("transmla"), CalibrationOptions()
    return (*o.size(method.default_calibration), o.seed), o.propagate or method.default_propagate


