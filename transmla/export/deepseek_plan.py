"""The DeepSeek export decided before a tensor is written: the DeepSeek-V3 config.json and the plan
of every layer's mapping (export/deepseek.py states the rules), from a native model's config and
MLAConfig; and what a source model already decides (checked before converting)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checkpoint.resolve import load_config
from ..families import family_for
from ..mla.config import MLAConfig
from ..mla.model import is_mla_config, source_model_type
from .deepseek_rope import deepseek_softmax_scale, shared_rope_grid, source_rope_parameters
from .engines import padded_latent_size, source_report
from .errors import ExportError
from .options import ExportOptions

LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV3 hard-codes this eps for kv_a/q_a_layernorm


NORM_TRICK_TOLERANCE = 1e-9  # s^2 * bound(mean c^2) / eps: relative latent error <= 5e-10


FP16_SOURCE = "the model is fp16, which underflows the scaled latent rows; pass --dtype fp32 or bf16"


@dataclass
class ExportPlan:
    """Everything decided before a tensor is written."""

    config: dict  # the DeepSeek-V3 config.json
    num_layers: int
    num_heads: int
    d_nope: int
    d_r: int
    d_v: int
    d_v_out: int  # after --pad-value
    d_c: int
    d_c_out: int  # after --pad-latent
    hidden_size: int
    q_scale: float  # native softmax_scale / DeepSeek's scale, folded into the query rows
    pair_order: list[int]  # native rope pair of each DeepSeek pair (descending frequency)
    q_bias_lora: bool  # the query bias travels through a full-rank q_a path
    drop_biases: bool
    native_norm: bool  # the native model has its own latent RMSNorm (eps 1e-6)
    family_layer_root: str
    input_norm: str
    record: dict = field(default_factory=dict)
    # One MoE tensor (layer prefix stripped) -> DeepSeek's names; None for dense models.
    moe_tensors: Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]] | None] | None = None


def read_native_config(model_dir: Path) -> tuple:
    """(the transformers config, its MLAConfig) of a native converted model."""
    if not (Path(model_dir) / "config.json").is_file():
        raise ExportError(f"{model_dir} has no config.json")
    config = load_config(model_dir)
    if not is_mla_config(config):
        raise ExportError(f"{model_dir} is not a converted MLA model (run `transmla convert` first)")
    return config, MLAConfig.from_dict(config.mla)


# A QK-norm model (Qwen3, Gemma 3): its cache rows need the source's per-KV-head key norm, which
# DeepSeek's layout cannot write (its one kv_a_layernorm normalises the whole latent).
QK_NORM = ("the model normalises each key head before RoPE (the source's k_norm, QK-norm); DeepSeek's format "
           "has only a norm over the whole latent, so no DeepSeek or GGUF export is exact")


# A model with sliding-window layers (Mistral's 4096, Qwen2/Qwen3 with use_sliding_window, Gemma 3): DeepSeek's
# format and llama.cpp's deepseek2 attend to every cached token, so past the window they would not be the source.
def sliding_refusal(windows: list[int]) -> str:
    layers = [i for i, w in enumerate(windows) if w]
    return (f"{len(layers)} layer(s) attend within a sliding window ({windows[layers[0]]} tokens, from layer {layers[0]}); "
            "DeepSeek's format and llama.cpp's deepseek2 have no sliding window, so no DeepSeek or GGUF export is "
            "exact past it")


def plan_export(config, mla: MLAConfig, options: ExportOptions, engines: tuple[str, ...],
                has_bias: dict[str, bool]) -> ExportPlan:
    """config: the native model's transformers config, mla its MLAConfig; engines: those the
    export must load in (refusing what they cannot)."""
    if mla.qk_norm_kv_heads:
        raise ExportError(QK_NORM)
    if any(mla.sliding_windows):
        raise ExportError(sliding_refusal(mla.sliding_windows))
    cfg = config.to_dict()
    family = family_for(source_model_type(config))
    H, d_r, d_c = mla.num_heads, mla.qk_rope_head_dim, mla.kv_lora_rank
    d_nope, d_v, D = mla.qk_nope_head_dim, mla.v_head_dim, mla.hidden_size
    L = len(mla.rope_inv_freq)
    max_positions = int(cfg.get("max_position_embeddings", 4096))
    rope, order = shared_rope_grid(mla, source_rope_parameters(cfg), max_positions)
    if mla.kv_a_norm and not math.isclose(mla.rms_norm_eps, LATENT_NORM_EPS):
        raise ExportError(
            f"the model's latent RMSNorm uses eps {mla.rms_norm_eps}; DeepSeek engines fix {LATENT_NORM_EPS}"
        )
    if mla.q_lora_rank and has_bias["q"]:
        raise ExportError("a low-rank query with a bias has no exact DeepSeek form (q_b_proj has no bias)")
    if mla.q_lora_rank and mla.q_a_norm and not math.isclose(mla.rms_norm_eps, LATENT_NORM_EPS):
        raise ExportError(f"the query RMSNorm uses eps {mla.rms_norm_eps}; DeepSeek engines fix {LATENT_NORM_EPS}")
    any_bias = any(has_bias.values())
    _check_biases(any_bias, engines, options.drop_biases)
    keep_bias = any_bias and not options.drop_biases
    d_c_out = d_c
    if options.pad_latent:
        d_c_out = padded_latent_size(d_c, d_r, options.pad_width)
    d_v_out = d_nope + d_r if options.pad_value else d_v
    q_lora = mla.q_lora_rank
    q_bias_lora = keep_bias and has_bias["q"]
    qk = d_nope + d_r
    rope_params = dict(rope)
    q_scale = float(mla.softmax_scale) / deepseek_softmax_scale(rope_params, qk)
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": cfg["vocab_size"],
        "hidden_size": D,
        "intermediate_size": cfg["intermediate_size"],
        "moe_intermediate_size": cfg["intermediate_size"],
        "num_hidden_layers": L,
        "num_attention_heads": H,
        "num_key_value_heads": H,
        # Dense: every layer is one of the first_k_dense_replace dense layers; the MoE fields are
        # still read (as integers) by some engines, so they hold small valid values.
        "first_k_dense_replace": L,
        "moe_layer_freq": 1,
        "n_routed_experts": 1,
        "n_shared_experts": 1,
        "num_experts_per_tok": 1,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": True,
        "num_nextn_predict_layers": 0,
        "kv_lora_rank": d_c_out,
        "q_lora_rank": (D + 1) if q_bias_lora else q_lora,
        "qk_rope_head_dim": d_r,
        "qk_nope_head_dim": d_nope,
        "v_head_dim": d_v_out,
        "hidden_act": cfg.get("hidden_act", "silu"),
        "max_position_embeddings": max_positions,
        "rms_norm_eps": LATENT_NORM_EPS,
        "rope_parameters": rope_params,
        "rope_interleave": True,
        "attention_bias": bool(keep_bias),
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "bos_token_id": cfg.get("bos_token_id"),
        "eos_token_id": cfg.get("eos_token_id"),
        "pad_token_id": cfg.get("pad_token_id"),
        "initializer_range": cfg.get("initializer_range", 0.02),
    }
    if family.moe is not None:
        config.update(_moe_config(cfg, family.moe))
    source_eps = cfg.get("rms_norm_eps", LATENT_NORM_EPS)
    record = {
        "source_model_type": cfg["model_type"],
        "engines": list(engines),
        "source_rms_norm_eps": source_eps,
        "rms_norm_eps_changed": not math.isclose(source_eps, LATENT_NORM_EPS),
        "kv_lora_rank_native": d_c,
        "padded_latent": d_c_out != d_c,
        "padded_value": d_v_out != d_v,
        "kv_elements_per_token_per_layer": d_c_out + d_r,
        "native_kv_elements_per_token_per_layer": d_c + d_r,
        "dropped_biases": any_bias and options.drop_biases,
        "query_bias_via_q_lora": q_bias_lora,
        "moe": family.moe is not None,
    }
    return ExportPlan(
        config=config, num_layers=L, num_heads=H, d_nope=d_nope, d_r=d_r, d_v=d_v, d_v_out=d_v_out, d_c=d_c, d_c_out=d_c_out,
        hidden_size=D, q_scale=q_scale, pair_order=order, q_bias_lora=q_bias_lora, drop_biases=not keep_bias,
        native_norm=bool(mla.kv_a_norm), family_layer_root=family.layer_root,
        input_norm=family.input_norm, record=record,
        moe_tensors=family.moe.deepseek_tensors if family.moe is not None else None,
    )


def _check_biases(any_bias: bool, engines: tuple[str, ...], drop_biases: bool) -> None:
    biased_engines = [e for e in engines if e != "transformers"]
    if any_bias and biased_engines and not drop_biases:
        raise ExportError(
            f"{biased_engines[0]} has no attention biases (it would drop them silently): pass --drop-biases "
            f"(lossy; measure it) or --engines transformers (exact)"
        )


def check_source(config, options: ExportOptions) -> None:
    """What a source model (a transformers config) already decides about its DeepSeek export, checked
    before converting (`convert --format deepseek`) so that a refused export fails before the slow
    part and writes nothing: QK-norm, attention biases for engines without them, the MoE router and the
    rope scaling per engine, sliding-window layers, an fp16 model. The rest (rope grid, latent width) is checked after."""
    family = family_for(config)
    if family.qk_norm:
        raise ExportError(QK_NORM)
    windows = [family.window(config, i) or 0 for i in range(int(config.num_hidden_layers))]
    if any(windows):
        raise ExportError(sliding_refusal(windows))
    engines = options.engine_names
    _check_biases(family.has_qkv_bias(config) or family.has_o_bias(config), engines, options.drop_biases)
    cfg = config.to_dict()
    layers = int(cfg["num_hidden_layers"])
    probe = {"num_hidden_layers": layers, "first_k_dense_replace": 0 if family.moe else layers,
             "rope_parameters": source_rope_parameters(cfg)}
    if family.moe is not None:
        probe["scoring_func"] = family.moe.scoring_func
    report = source_report(probe)
    for engine in engines:
        if report[engine] is not None:
            raise ExportError(f"{engine} would not load this export: {report[engine]}")
    if options.dtype is None and native_dtype(cfg) == torch.float16:
        raise ExportError(FP16_SOURCE)


def _moe_config(cfg: dict, moe) -> dict:
    """DeepSeek MoE fields that route exactly as the source: every layer sparse, a shared expert of
    zero width (transformers 5's config takes only an integer count, so not null), one expert group
    (plain top-k), no score correction, the source's scoring and renormalisation, routed weights
    unscaled. transformers' DeepseekV3 ignores `scoring_func` (it always uses a sigmoid); vLLM's
    DeepseekV2/V3 MoE reads it (engines.py says which engine takes what)."""
    return {
        "first_k_dense_replace": 0,
        "n_routed_experts": int(cfg[moe.experts_key]),
        "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
        "moe_intermediate_size": cfg["intermediate_size"],
        "n_shared_experts": 0,
        "scoring_func": moe.scoring_func,
        "norm_topk_prob": moe.renormalize,
        "topk_method": "greedy",
        "routed_scaling_factor": 1.0,
    }


def native_dtype(cfg: dict) -> torch.dtype:
    name = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
    return getattr(torch, name.replace("torch.", ""), torch.float32)


__all__ = ["ExportPlan", "LATENT_NORM_EPS", "check_source", "native_dtype", "plan_export", "read_native_config"]
