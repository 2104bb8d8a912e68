"""The math of one layer's DeepSeek export (pure: tensors in, tensors out): the rope rows
interleaved, the softmax-scale ratio folded into the queries, the latent-norm trick (rule 1 of
export/deepseek.py), the latent and the values padded, and the biases moved where DeepSeek has them."""

from __future__ import annotations

import math

import torch

from .deepseek_plan import LATENT_NORM_EPS, NORM_TRICK_TOLERANCE, ExportPlan


def interleave_rows(pair_order: list[int]) -> torch.Tensor:
    """Row permutation of a rope block: DeepSeek dims (2i, 2i+1) = native dims (p_i, p_i + d_r/2)."""
    half = len(pair_order)
    p = torch.tensor(pair_order, dtype=torch.long)
    return torch.stack((p, p + half), dim=1).reshape(-1)  # [d_r]


def norm_trick_scale(weight: torch.Tensor, bias: torch.Tensor | None, input_norm: torch.Tensor, rows: int,
                     eps: float = LATENT_NORM_EPS) -> float:
    """The power of two s with s^2 * max mean(c^2) / eps <= NORM_TRICK_TOLERANCE, c = W x + b.

    weight [rows, D]; input_norm [D] the layer's input RMSNorm weight: |x|^2 <= D max(w^2).
    """
    D = weight.shape[1]
    x_norm = math.sqrt(D) * float(input_norm.double().abs().max())
    sigma = float(torch.linalg.matrix_norm(weight.double(), ord=2)) if weight.numel() else 0.0
    c_norm = sigma * x_norm + (float(bias.double().norm()) if bias is not None else 0.0)
    bound = max(c_norm**2 / rows, 1e-30)  # >= mean(c^2) for every token
    s = math.sqrt(NORM_TRICK_TOLERANCE * eps / bound)
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
    w_b = torch.cat((w_b, zeros(w_b.shape[0], pad)), dim=1).view(H, d_nope + d_v, plan.d_c_out)
    # --pad-value: each head's value gains zero rows, which o_proj's zero columns read: softmax-weighted
    # sums of zeros stay zero, so the output is exactly the native one.
    v_pad = plan.d_v_out - d_v
    out["kv_b_proj.weight"] = torch.cat((w_b, zeros(H, v_pad, plan.d_c_out)), dim=1).reshape(-1, plan.d_c_out)  # [H*(d_nope+d_v_out), d_c_out]

    # Output: kv_b's value bias passes through the attention (weights sum to one) into o_proj's bias;
    # its key bias shifts all scores of a query equally and softmax drops it.
    w_o = f64("o_proj.weight")  # [D, H*d_v]
    out["o_proj.weight"] = torch.cat((w_o.view(D, H, d_v), zeros(D, H, v_pad)), dim=2).reshape(D, -1)  # [D, H*d_v_out]
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


__all__ = ["export_layer", "interleave_rows", "norm_trick_scale"]
