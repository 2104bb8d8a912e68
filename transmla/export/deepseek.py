"""DeepSeek-V3 export: a native MLA checkpoint as a stock `DeepseekV3ForCausalLM` folder.

Stock engines (transformers, vLLM, SGLang) run DeepSeek's MLA natively, but with three rules our
native format does not have (ALGORITHMS.md, "DeepSeek-V3 layout"); each is mapped exactly:

1. Latent RMSNorm. Engines always apply kv_a_layernorm to the latent c. With the latent rows of
   kv_a_proj scaled by a tiny s (a power of two, exact in any float format) and the norm weight
   sqrt(eps)/s:  w * s c / sqrt(mean((s c)^2) + eps) = c / sqrt(1 + s^2 mean(c^2) / eps),
   a relative error of s^2 mean(c^2) / (2 eps). mean(c^2) is bounded from the weights alone:
   the attention input is x = w_ln * h / rms(h), so |x|^2 <= D max(w_ln^2) and
   |c| <= sigma_max(W_lat) |x| + |b|. s is chosen so that s^2 bound / eps <= NORM_TRICK_TOLERANCE.
   The eps must be the one every engine uses: transformers fixes 1e-6 for this norm, vLLM and
   llama.cpp read rms_norm_eps, so the export sets rms_norm_eps = 1e-6 for every norm.
2. Softmax scale. DeepSeek uses (d_nope + d_r)^-1/2 (times the yarn mscale^2); a conversion keeps
   the source's 1/sqrt(d). The ratio is folded into the query rows (scores are linear in q).
3. RoPE. One frequency grid theta^(-2i/d_r) for every layer, on interleaved pairs (2i, 2i+1)
   (rope_interleave). Our rope key stores any per-layer frequencies on rotate-half pairs
   (p, p + d_r/2): the pairs are reordered by frequency and interleaved (the same permutation on
   the queries' rope rows, so every score is unchanged); frequencies that are not one grid in
   every layer cannot be exported and are refused.

Biases (Qwen2's q/k/v): the latent and rope-key biases go to kv_a_proj_with_mqa's bias; kv_b's
key bias adds q_nope . b_k[h] to every score of a query, which softmax drops (exact); its value
bias passes through the attention (weights sum to one) and is folded into o_proj's bias. A query
bias has no place in DeepSeek's q_proj: it is carried by a full-rank q_a path,
q_a = [s I; 0] x + [0; s] -> q_a_layernorm (the same norm trick) -> [x; 1] -> q_b = [W_q | b_q].
Only transformers loads attention biases; the other engines are refused (engines.py) unless
--drop-biases.

The pieces: deepseek_plan (the config and plan, decided and checked before a tensor is written),
deepseek_rope (rules 2 and 3: the shared rope grid, the softmax scale), deepseek_layer (one
layer's math); this module streams the native model through them and writes the folder.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint.files import copy_tokenizer_files
from ..checkpoint.reader import SafetensorsReader
from ..checkpoint.writer import ShardedWriter, atomic_output_dir
from ..dtypes import torch_dtype
from ..families import family_for
from ..mla.model import source_model_type
from ..progress import progress_bar
from .deepseek_layer import export_layer
from .deepseek_plan import FP16_SOURCE, ExportPlan, native_dtype, plan_export, read_native_config
from .engines import engine_report
from .errors import ExportError
from .options import ExportOptions

EXPORT_KEY = "transmla_export"  # our record in the exported config.json


def _bias_presence(reader: SafetensorsReader, root: str) -> dict[str, bool]:
    a = root.format(i=0) + "self_attn."
    return {
        "q": f"{a}q_proj.bias" in reader or f"{a}q_b_proj.bias" in reader,
        "kv_a": f"{a}kv_a_proj.bias" in reader,
        "kv_b": f"{a}kv_b_proj.bias" in reader,
        "o": f"{a}o_proj.bias" in reader,
    }


def _check_finite(name: str, tensor: torch.Tensor) -> None:
    if tensor.is_floating_point() and not torch.isfinite(tensor).all():
        raise ExportError(f"non-finite values in {name}; nothing written")


def deepseek_tensors(reader: SafetensorsReader, plan: ExportPlan, progress: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, fp64/native tensor) of the DeepSeek checkpoint, one layer's attention at a time."""
    attention = {}
    for name in reader.keys():
        for i in range(plan.num_layers):
            prefix = plan.family_layer_root.format(i=i) + "self_attn."
            if name.startswith(prefix):
                attention.setdefault(i, []).append(name)
                break
    passed = set().union(*attention.values()) if attention else set()
    for name in reader.keys():
        if name not in passed:
            yield from _renamed(name, reader.get(name), plan)
    if "lm_head.weight" not in reader:  # tied embeddings: written out (not every engine ties)
        yield "lm_head.weight", reader.get("model.embed_tokens.weight").clone()  # its own storage
    for i in progress_bar(range(plan.num_layers), "exporting layers", enabled=progress):
        prefix = plan.family_layer_root.format(i=i) + "self_attn."
        tensors = {n[len(prefix):]: reader.get(n) for n in attention.get(i, [])}
        norm = reader.get(plan.family_layer_root.format(i=i) + plan.input_norm + ".weight")
        for rel, tensor in export_layer(tensors, norm, plan).items():
            yield f"model.layers.{i}.self_attn.{rel}", tensor


def _renamed(name: str, tensor: torch.Tensor, plan: ExportPlan) -> Iterator[tuple[str, torch.Tensor]]:
    """A non-attention tensor under DeepSeek's name: MoE tensors through the family's mapping,
    everything else (embeddings, norms, dense MLPs) unchanged."""
    if plan.moe_tensors is not None:
        for i in range(plan.num_layers):
            prefix = plan.family_layer_root.format(i=i)
            if name.startswith(prefix):
                mapped = plan.moe_tensors(name[len(prefix):], tensor)
                if mapped is not None:
                    for rel, t in mapped:
                        yield f"model.layers.{i}.{rel}", t
                    return
                break
    yield name, tensor


@dataclass
class ExportResult:
    output: str
    format: str
    engines: dict[str, str | None]  # engine -> None (loads) or the reason it does not
    kv_elements_per_token_per_layer: int
    record: dict
    files: list[str]


def prepare_export(model_dir: str | Path, options: ExportOptions,
                   engines: tuple[str, ...] | None = None) -> tuple[object, ExportPlan]:
    """Read and check a native model's config and decide the export (no tensor written): (its
    transformers config, the plan). engines: those it must load in (default: the options'; the
    GGUF export asks for none)."""
    model_dir = Path(model_dir)
    engines = options.engine_names if engines is None else engines
    config, mla = read_native_config(model_dir)
    family = family_for(source_model_type(config))
    with SafetensorsReader(model_dir) as reader:
        has_bias = _bias_presence(reader, family.layer_root)
    plan = plan_export(config, mla, options, engines, has_bias)
    report = engine_report(plan.config)
    for engine in engines:
        if report[engine] is not None:
            raise ExportError(f"{engine} would not load this export: {report[engine]}")
    return config, plan


def export_deepseek(model_dir: str | Path, output: str | Path, options: ExportOptions, progress: bool = True) -> ExportResult:
    """Write `model_dir` (a native converted model) as a stock DeepSeek-V3 folder at `output`."""
    from transformers import DeepseekV3Config

    model_dir = Path(model_dir)
    options.refuse_fp16()
    config, plan = prepare_export(model_dir, options)
    out_dtype = torch_dtype(options.dtype) if options.dtype else native_dtype(config.to_dict())
    if out_dtype == torch.float16:
        raise ExportError(FP16_SOURCE)
    with SafetensorsReader(model_dir) as reader, atomic_output_dir(output, force=options.force) as tmp:
        writer = ShardedWriter(tmp, options.max_shard_size)
        for name, tensor in deepseek_tensors(reader, plan, progress):
            tensor = tensor.to(out_dtype) if tensor.is_floating_point() else tensor
            _check_finite(name, tensor)
            writer.add(name, tensor)
        files = writer.close()
        config = DeepseekV3Config(**plan.config)
        config.dtype = out_dtype
        config.save_pretrained(tmp)
        data = json.loads((tmp / "config.json").read_text())
        for derived in ("head_dim", "qk_head_dim"):  # recomputed on load; a stale head_dim misleads some engines
            data.pop(derived, None)
        # SGLang (and older vLLM) read the rope from top-level rope_theta / rope_scaling.
        rope = plan.config["rope_parameters"]
        data["rope_theta"] = rope["rope_theta"]
        data["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else dict(rope)
        data[EXPORT_KEY] = plan.record
        (tmp / "config.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        copy_tokenizer_files(model_dir, tmp)
    return ExportResult(
        output=str(output), format="deepseek", engines=engine_report(plan.config),
        kv_elements_per_token_per_layer=plan.d_c_out + plan.d_r, record=plan.record, files=files,
    )
