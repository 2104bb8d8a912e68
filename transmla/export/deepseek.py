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
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checkpoint.files import copy_tokenizer_files
from ..checkpoint.reader import SafetensorsReader
from ..checkpoint.resolve import load_config
from ..checkpoint.writer import ShardedWriter, atomic_output_dir
from ..dtypes import torch_dtype
from ..families import family_for
from ..mla.config import MLAConfig
from ..mla.model import is_mla_config, source_model_type
from ..progress import progress_bar
from .engines import engine_report, padded_latent_size, source_report
from .errors import ExportError
from .options import ExportOptions

LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV3 hard-codes this eps for kv_a/q_a_layernorm
NORM_TRICK_TOLERANCE = 1e-9  # s^2 * bound(mean c^2) / eps: relative latent error <= 5e-10
EXPORT_KEY = "transmla_export"  # our record in the exported config.json
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


# --------------------------------------------------------------------------------------------
# Reading the native model
# --------------------------------------------------------------------------------------------


def read_native_config(model_dir: Path) -> tuple:
    """(the transformers config, its MLAConfig) of a native converted model."""
    if not (Path(model_dir) / "config.json").is_file():
        raise ExportError(f"{model_dir} has no config.json")
    config = load_config(model_dir)
    if not is_mla_config(config):
        raise ExportError(f"{model_dir} is not a converted MLA model (run `transmla convert` first)")
    return config, MLAConfig.from_dict(config.mla)


def _source_rope_parameters(cfg: dict) -> dict:
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if "rope_theta" not in params and "rope_theta" in cfg:
        params["rope_theta"] = cfg["rope_theta"]
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def _deepseek_rope(rope_parameters: dict, d_r: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [d_r/2] and cos/sin scale that stock DeepseekV3 computes for these settings."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    config = DeepseekV3Config(
        hidden_size=64, num_attention_heads=1, qk_rope_head_dim=d_r, max_position_embeddings=max_positions,
        rope_parameters=dict(rope_parameters),
    )
    rotary = DeepseekV3RotaryEmbedding(config)
    return rotary.inv_freq.float(), float(rotary.attention_scaling)


def shared_rope_grid(mla: MLAConfig, source_rope: dict, max_positions: int) -> tuple[dict, list[int]]:
    """The DeepSeek rope_parameters and pair order that reproduce every layer's rope key exactly.

    The kept frequencies must be the same in every layer and, sorted descending, equal the grid
    DeepseekV3 computes: theta'^(-2i/d_r) (then the source's scaling, e.g. llama3), with theta'
    fitted from the second frequency (the grid starts at 1).
    """
    freqs = torch.tensor(mla.rope_inv_freq, dtype=torch.float64)  # [L, d_r/2]
    d_r = mla.qk_rope_head_dim
    hint = "convert with --shared-rope (TransMLA) or --format deepseek, which keep one grid in every layer"
    if d_r == 0:
        raise ExportError("the model has no rope key (qk_rope_head_dim 0); DeepSeek needs at least one rope pair")
    if not torch.allclose(freqs, freqs[:1].expand_as(freqs), rtol=1e-6, atol=0):
        raise ExportError(f"rope frequencies differ between layers; DeepSeek shares one rope in all layers: {hint}")
    layer = freqs[0]
    order = torch.argsort(layer, descending=True, stable=True)
    ranked = layer[order]
    params = {k: v for k, v in source_rope.items() if k != "rope_theta"}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        # theta'^(-2/d_r) = w_1 / w_0 with w_0 = 1: the grid's ratio fixes theta'.
        source_theta = float(source_rope.get("rope_theta", 10000.0))
        theta = source_theta if ranked.numel() < 2 else float((ranked[0] / ranked[1]) ** (d_r / 2))
        if math.isclose(theta, source_theta, rel_tol=1e-4):  # FreqFold's grid: the source's own theta
            theta = source_theta
    else:  # scaled ropes (llama3, linear, yarn): the grid must be the source theta's
        theta = float(source_rope["rope_theta"])
    params["rope_theta"] = theta
    grid, scaling = _deepseek_rope(params, d_r, max_positions)
    if not torch.allclose(ranked.float(), grid, rtol=2e-6, atol=0):
        raise ExportError(
            f"the rope frequencies are not one grid theta^(-2i/{d_r}) ({rope_type} rope); "
            f"DeepSeek cannot represent them: {hint}"
        )
    if not math.isclose(scaling, float(mla.rope_attention_scaling), rel_tol=1e-6):
        raise ExportError(
            f"the {rope_type} rope's attention scaling {mla.rope_attention_scaling} differs from the "
            f"{scaling} DeepSeek computes for {d_r} rope dims; not representable"
        )
    return params, order.tolist()


def deepseek_softmax_scale(rope_parameters: dict, qk_head_dim: int) -> float:
    """DeepSeek's scale: qk_head_dim^-1/2, times mscale^2 for yarn with mscale_all_dim (as every engine)."""
    scale = qk_head_dim**-0.5
    factor, mscale_all_dim = rope_parameters.get("factor", 1.0), rope_parameters.get("mscale_all_dim", 0)
    if rope_parameters.get("rope_type", "default") != "default" and mscale_all_dim and factor > 1:
        m = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= m * m
    return scale


# --------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------


def plan_export(config, mla: MLAConfig, options: ExportOptions, engines: tuple[str, ...],
                has_bias: dict[str, bool]) -> ExportPlan:
    """config: the native model's transformers config, mla its MLAConfig; engines: those the
    export must load in (refusing what they cannot)."""
    cfg = config.to_dict()
    family = family_for(source_model_type(config))
    H, d_r, d_c = mla.num_heads, mla.qk_rope_head_dim, mla.kv_lora_rank
    d_nope, d_v, D = mla.qk_nope_head_dim, mla.v_head_dim, mla.hidden_size
    L = len(mla.rope_inv_freq)
    max_positions = int(cfg.get("max_position_embeddings", 4096))
    rope, order = shared_rope_grid(mla, _source_rope_parameters(cfg), max_positions)
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
        d_c_out = padded_latent_size(d_c, d_r)
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
        "v_head_dim": d_v,
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
        "kv_elements_per_token_per_layer": d_c_out + d_r,
        "native_kv_elements_per_token_per_layer": d_c + d_r,
        "dropped_biases": any_bias and options.drop_biases,
        "query_bias_via_q_lora": q_bias_lora,
        "moe": family.moe is not None,
    }
    return ExportPlan(
        config=config, num_layers=L, num_heads=H, d_nope=d_nope, d_r=d_r, d_v=d_v, d_c=d_c, d_c_out=d_c_out,
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
    part and writes nothing: attention biases for engines without them, the MoE router and the rope
    scaling per engine, an fp16 model. The rest (rope grid, latent width) is checked after."""
    family = family_for(config)
    engines = options.engine_names
    _check_biases(family.has_qkv_bias(config) or family.has_o_bias(config), engines, options.drop_biases)
    cfg = config.to_dict()
    layers = int(cfg["num_hidden_layers"])
    probe = {"num_hidden_layers": layers, "first_k_dense_replace": 0 if family.moe else layers,
             "rope_parameters": _source_rope_parameters(cfg)}
    if family.moe is not None:
        probe["scoring_func"] = family.moe.scoring_func
    report = source_report(probe)
    for engine in engines:
        if report[engine] is not None:
            raise ExportError(f"{engine} would not load this export: {report[engine]}")
    if options.dtype is None and _native_dtype(cfg) == torch.float16:
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


# --------------------------------------------------------------------------------------------
# The math of one layer (pure: tensors in, tensors out)
# --------------------------------------------------------------------------------------------


def interleave_rows(pair_order: list[int]) -> torch.Tensor:
    """Row permutation of a rope block: DeepSeek dims (2i, 2i+1) = native dims (p_i, p_i + d_r/2)."""
    half = len(pair_order)
    p = torch.tensor(pair_order, dtype=torch.long)
    return torch.stack((p, p + half), dim=1).reshape(-1)  # [d_r]


def norm_trick_scale(weight: torch.Tensor, bias: torch.Tensor | None, input_norm: torch.Tensor, rows: int) -> float:
    """The power of two s with s^2 * max mean(c^2) / eps <= NORM_TRICK_TOLERANCE, c = W x + b.

    weight [rows, D]; input_norm [D] the layer's input RMSNorm weight: |x|^2 <= D max(w^2).
    """
    D = weight.shape[1]
    x_norm = math.sqrt(D) * float(input_norm.double().abs().max())
    sigma = float(torch.linalg.matrix_norm(weight.double(), ord=2)) if weight.numel() else 0.0
    c_norm = sigma * x_norm + (float(bias.double().norm()) if bias is not None else 0.0)
    bound = max(c_norm**2 / rows, 1e-30)  # >= mean(c^2) for every token
    s = math.sqrt(NORM_TRICK_TOLERANCE * LATENT_NORM_EPS / bound)
    return 2.0 ** math.floor(math.log2(s))


def export_layer(t: dict[str, torch.Tensor], input_norm: torch.Tensor, plan: ExportPlan) -> dict[str, torch.Tensor]:
    """One layer's native attention tensors (names relative to self_attn.) -> DeepSeek's (same)."""
    H, d_nope, d_r, d_v, d_c = plan.num_heads, plan.d_nope, plan.d_r, plan.d_v, plan.d_c
    D, qk = plan.hidden_size, plan.d_nope + plan.d_r
    f64 = lambda name: None if t.get(name) is None else t[name].double()  # noqa: E731
    rope_rows = interleave_rows(plan.pair_order)  # [d_r]
    head_rows = torch.cat((torch.arange(d_nope), d_nope + rope_rows))  # [qk] per head
    q_rows = (torch.arange(H)[:, None] * qk + head_rows[None]).reshape(-1)  # [H*qk]
    keep_bias = not plan.drop_biases
    out: dict[str, torch.Tensor] = {}

    # Query: softmax-scale ratio folded in, rope rows interleaved.
    if "q_a_proj.weight" in t:
        out["q_a_proj.weight"] = t["q_a_proj.weight"].double()
        if "q_a_norm.weight" in t:
            out["q_a_layernorm.weight"] = t["q_a_norm.weight"].double()
        else:  # no native query norm: the norm trick makes DeepSeek's q_a_layernorm a no-op
            s = norm_trick_scale(out["q_a_proj.weight"], None, input_norm, out["q_a_proj.weight"].shape[0])
            out["q_a_proj.weight"] = out["q_a_proj.weight"] * s
            out["q_a_layernorm.weight"] = torch.full((out["q_a_proj.weight"].shape[0],), math.sqrt(LATENT_NORM_EPS) / s)
        out["q_b_proj.weight"] = f64("q_b_proj.weight")[q_rows] * plan.q_scale  # [H*qk, d_q]
    else:
        wq = f64("q_proj.weight")[q_rows] * plan.q_scale  # [H*qk, D]
        bq = f64("q_proj.bias")
        if plan.q_bias_lora:
            # q_a = [s I; 0] x + [0; s] -> norm -> [x; 1];  q_b = [W_q | b_q]
            eye = torch.eye(D + 1, D, dtype=torch.float64)  # [D+1, D]
            s = norm_trick_scale(eye, torch.eye(D + 1, dtype=torch.float64)[-1], input_norm, D + 1)
            out["q_a_proj.weight"] = eye * s
            out["q_a_proj.bias"] = torch.zeros(D + 1, dtype=torch.float64)
            out["q_a_proj.bias"][-1] = s
            out["q_a_layernorm.weight"] = torch.full((D + 1,), math.sqrt(LATENT_NORM_EPS) / s)
            out["q_b_proj.weight"] = torch.cat((wq, bq[q_rows, None] * plan.q_scale), dim=1)  # [H*qk, D+1]
        else:
            out["q_proj.weight"] = wq

    # Latent and rope key: latent rows scaled by s (norm trick), padded, rope rows interleaved.
    w_kv = f64("kv_a_proj.weight")  # [d_c + d_r, D]
    b_kv = f64("kv_a_proj.bias") if keep_bias else None
    w_lat, w_rope = w_kv[:d_c], w_kv[d_c:][rope_rows]
    b_lat = None if b_kv is None else b_kv[:d_c]
    if plan.native_norm:
        s, norm = 1.0, f64("kv_a_norm.weight")
    else:
        s = norm_trick_scale(w_lat, b_lat, input_norm, d_c)
        norm = torch.full((d_c,), math.sqrt(LATENT_NORM_EPS) / s, dtype=torch.float64)
    pad = plan.d_c_out - d_c
    zeros = lambda *shape: torch.zeros(*shape, dtype=torch.float64)  # noqa: E731
    out["kv_a_proj_with_mqa.weight"] = torch.cat((w_lat * s, zeros(pad, D), w_rope))  # [d_c_out + d_r, D]
    out["kv_a_layernorm.weight"] = torch.cat((norm, torch.ones(pad, dtype=torch.float64)))  # padded dims stay 0
    w_b = f64("kv_b_proj.weight")  # [H*(d_nope+d_v), d_c]
    out["kv_b_proj.weight"] = torch.cat((w_b, zeros(w_b.shape[0], pad)), dim=1)  # [H*(d_nope+d_v), d_c_out]

    # Output: kv_b's value bias passes through the attention (weights sum to one) into o_proj's bias;
    # its key bias shifts all scores of a query equally and softmax drops it.
    w_o = f64("o_proj.weight")  # [D, H*d_v]
    out["o_proj.weight"] = w_o
    if keep_bias and plan.config["attention_bias"]:
        b_o = f64("o_proj.bias") if t.get("o_proj.bias") is not None else zeros(D)
        b_kvb = f64("kv_b_proj.bias")
        if b_kvb is not None:
            b_v = b_kvb.view(H, d_nope + d_v)[:, d_nope:].reshape(-1)  # [H*d_v]
            b_o = b_o + w_o @ b_v
        out["o_proj.bias"] = b_o
        b_rope = zeros(d_r) if b_kv is None else b_kv[d_c:][rope_rows]
        b_lat_out = zeros(d_c) if b_lat is None else b_lat * s
        out["kv_a_proj_with_mqa.bias"] = torch.cat((b_lat_out, zeros(pad), b_rope))
        if "q_a_proj.weight" in out and "q_a_proj.bias" not in out:
            out["q_a_proj.bias"] = zeros(out["q_a_proj.weight"].shape[0])
    return out


# --------------------------------------------------------------------------------------------
# Streaming the whole model
# --------------------------------------------------------------------------------------------


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
    out_dtype = torch_dtype(options.dtype) if options.dtype else _native_dtype(config.to_dict())
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


def _native_dtype(cfg: dict) -> torch.dtype:
    name = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
    return getattr(torch, name.replace("torch.", ""), torch.float32)
