"""MLAAttention: Multi-head Latent Attention over a latent KV cache.

Per token x [D]: latent c = W_DKV x [d_c] (optionally RMS-normed), shared rope key
k_r = RoPE(W_KR x) [d_r]; kv_a_proj = [W_DKV; W_KR]. The cache holds exactly (c, k_r).
Head h: q_h = [q_nope (d_nope) | q_rope (d_r)], k_h = [W_UK[h] c | k_r], v_h = W_UV[h] c,
kv_b_proj = per head [W_UK[h]; W_UV[h]]. Two equal ways to attend:
- expanded (prefill/training): build K, V for every head, then SDPA;
- absorbed (decode): q_lat = W_UK[h]^T q_nope, score = q_lat . c + q_rope . k_r,
  o_lat = sum_t p_t c_t, out_h = W_UV[h] o_lat — MQA over the latent, nothing expanded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import MLAConfig
from .kernels import mla_decode


class MLARMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class MLAAttention(nn.Module):
    def __init__(self, config: MLAConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.is_causal = True
        c = config
        H, D = c.num_heads, c.hidden_size
        q_out = H * c.qk_head_dim
        if c.q_lora_rank:
            self.q_a_proj = nn.Linear(D, c.q_lora_rank, bias=False)
            self.q_a_norm = MLARMSNorm(c.q_lora_rank, c.rms_norm_eps) if c.q_a_norm else None
            self.q_b_proj = nn.Linear(c.q_lora_rank, q_out, bias=c.q_bias)
        else:
            self.q_proj = nn.Linear(D, q_out, bias=c.q_bias)
        self.kv_a_proj = nn.Linear(D, c.kv_lora_rank + c.qk_rope_head_dim, bias=c.kv_a_bias)
        self.kv_a_norm = MLARMSNorm(c.kv_lora_rank, c.rms_norm_eps) if c.kv_a_norm else None
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, H * (c.qk_nope_head_dim + c.v_head_dim), bias=c.kv_b_bias)
        self.o_proj = nn.Linear(H * c.v_head_dim, D, bias=c.o_bias)
        # Built from the config on first use: out of the state dict, out of dtype casts and of
        # meta-device initialisation, so the frequencies stay exact in fp32.
        self._inv_freq: torch.Tensor | None = None  # [d_r/2]

    # -- pieces -------------------------------------------------------------------------------
    def _rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self._inv_freq is None or self._inv_freq.device != position_ids.device:
            freqs = self.config.rope_inv_freq[self.layer_idx]
            self._inv_freq = torch.tensor(freqs, dtype=torch.float32, device=position_ids.device)
        inv_freq = self._inv_freq
        freqs = position_ids[..., None].float() * inv_freq  # [B, T, d_r/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, d_r]
        scale = self.config.rope_attention_scaling
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)

    def project_query(self, x: torch.Tensor) -> torch.Tensor:
        if self.config.q_lora_rank:
            q = self.q_a_proj(x)
            if self.q_a_norm is not None:
                q = self.q_a_norm(q)
            return self.q_b_proj(q)
        return self.q_proj(x)

    def compress(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, D] -> latent c [B, T, d_c] and un-rotated rope key [B, T, d_r]."""
        kv = self.kv_a_proj(x)
        latent, k_rope = kv.split([self.config.kv_lora_rank, self.config.qk_rope_head_dim], dim=-1)
        if self.kv_a_norm is not None:
            latent = self.kv_a_norm(latent)
        return latent, k_rope

    def up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, d_nope, d_c] and W_UV [H, d_v, d_c] from kv_b_proj."""
        c = self.config
        w = self.kv_b_proj.weight.view(c.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        return w[:, : c.qk_nope_head_dim], w[:, c.qk_nope_head_dim :]

    # -- forward ------------------------------------------------------------------------------
    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings=None,  # the source model's full-head cos/sin: unused, MLA has its own
        attention_mask: torch.Tensor | None = None,
        past_key_values=None,
        position_ids: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        c = self.config
        B, T, _ = hidden_states.shape
        if position_ids is None:
            past = past_key_values.get_seq_length(self.layer_idx) if past_key_values is not None else 0
            position_ids = torch.arange(past, past + T, device=hidden_states.device)[None]
        q = self.project_query(hidden_states).view(B, T, c.num_heads, c.qk_head_dim)
        q_nope, q_rope = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.compress(hidden_states)

        cos, sin = self._rope(position_ids.expand(B, -1), q.dtype)  # [B, T, d_r]
        q_rope = q_rope * cos[:, :, None] + rotate_half(q_rope) * sin[:, :, None]
        k_rope = k_rope * cos + rotate_half(k_rope) * sin

        if past_key_values is not None:
            # The cache stores the latent as "keys" and the rope key as "values": [B, 1, S, .].
            cached_latent, cached_rope = past_key_values.update(latent[:, None], k_rope[:, None], self.layer_idx)
            latent, k_rope = cached_latent[:, 0], cached_rope[:, 0]  # [B, S, d_c], [B, S, d_r]

        mask = self._sdpa_mask(attention_mask, T, latent.shape[1], hidden_states.device)
        if self._use_absorbed(T, past_key_values is not None):
            out = self._absorbed(q_nope, q_rope, latent, k_rope, mask, attention_mask)
        else:
            out = self._expanded(q_nope, q_rope, latent, k_rope, mask)
        return self.o_proj(out.reshape(B, T, c.num_heads * c.v_head_dim)), None

    def _use_absorbed(self, q_len: int, has_cache: bool) -> bool:
        mode = self.config.decode
        if mode != "auto":
            return mode == "absorbed"
        return has_cache and q_len <= self.config.absorb_max_query_tokens and not self.training

    @staticmethod
    def _sdpa_mask(attention_mask, q_len: int, kv_len: int, device) -> torch.Tensor | None:
        """A boolean [B|1, 1, T, S] mask (True = attend), bottom-right causal when none is given;
        None for plain causal attention without a cache offset (SDPA's is_causal, which lets it
        pick its flash / memory-efficient kernels)."""
        if attention_mask is None:
            if q_len == kv_len:
                return None
            offset = kv_len - q_len
            q_pos = torch.arange(q_len, device=device)[:, None] + offset
            return (torch.arange(kv_len, device=device)[None, :] <= q_pos)[None, None]
        mask = attention_mask[..., -q_len:, :kv_len]
        if mask.dtype != torch.bool:  # additive float mask (eager): 0 keeps, -inf drops
            mask = mask == 0
        return mask

    def _expanded(self, q_nope, q_rope, latent, k_rope, mask) -> torch.Tensor:
        c = self.config
        B, S = latent.shape[:2]
        kv = self.kv_b_proj(latent).view(B, S, c.num_heads, c.qk_nope_head_dim + c.v_head_dim)
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_rope[:, :, None].expand(-1, -1, c.num_heads, -1)), dim=-1)  # [B, S, H, d_qk]
        q = torch.cat((q_nope, q_rope), dim=-1)  # [B, T, H, d_qk]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=mask is None,
            scale=c.softmax_scale,
        )  # [B, H, T, d_v]
        return out.transpose(1, 2)  # [B, T, H, d_v]

    def _absorbed(self, q_nope, q_rope, latent, k_rope, mask, attention_mask) -> torch.Tensor:
        c = self.config
        w_uk, w_uv = self.up_weights()
        q_lat = torch.einsum("bthn,hnc->bthc", q_nope, w_uk)  # [B, T, H, d_c]
        # The K bias of kv_b_proj adds q_nope . b_k[h] to every score of a query: softmax drops it.
        if attention_mask is None:
            o_lat = mla_decode(q_lat, q_rope, latent, k_rope, c.softmax_scale)  # [B, T, H, d_c]
        else:  # padded batches: the general masked path (MQA with one latent KV head)
            q_cat = torch.cat((q_lat, q_rope), dim=-1).transpose(1, 2)  # [B, H, T, d_c + d_r]
            k_cat = torch.cat((latent, k_rope), dim=-1)[:, None]  # [B, 1, S, d_c + d_r]
            o_lat = F.scaled_dot_product_attention(
                q_cat, k_cat, latent[:, None], attn_mask=mask, scale=c.softmax_scale, enable_gqa=True
            ).transpose(1, 2)  # [B, T, H, d_c]
        out = torch.einsum("bthc,hvc->bthv", o_lat, w_uv)  # [B, T, H, d_v]
        if self.kv_b_proj.bias is not None:  # V bias passes through (weights sum to one)
            b_v = self.kv_b_proj.bias.view(c.num_heads, -1)[:, c.qk_nope_head_dim :]
            out = out + b_v
        return out
