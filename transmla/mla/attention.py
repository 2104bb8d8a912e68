"""MLAAttention: Multi-head Latent Attention over a latent KV cache.

Per token x [D]: latent c = W_DKV x [d_c] (optionally RMS-normed), shared rope key
k_r = RoPE(W_KR x) [d_r]; kv_a_proj = [W_DKV; W_KR]. The cache holds exactly (c, k_r).
Head h: q_h = [q_nope (d_nope) | q_rope (d_r)], k_h = [W_UK[h] c | k_r], v_h = W_UV[h] c,
kv_b_proj = per head [W_UK[h]; W_UV[h]]. Two equal ways to attend (which one runs: ``_use_absorbed``):
- expanded (training; prefill on GPUs): build K, V for every head, then SDPA;
- absorbed (decode): q_lat = W_UK[h]^T q_nope, score = q_lat . c + q_rope . k_r,
  o_lat = sum_t p_t c_t, out_h = W_UV[h] o_lat — MQA over the latent, nothing expanded.
  For many tokens at once (prefill) W_UK is folded into the query projection and W_UV into o_proj
  (``_folds``): one linear gives [q_lat | q_rope] per head, one linear maps o_lat to the output.
  The absorbed attention itself runs in the one kernel dispatch, kernels/backends.attend_rows
  (Triton on CUDA, C kernels on the CPU, PyTorch's SDPA for the rest).
QK-norm (config.qk_norm): the query linears read q~ = q_norm(q_pre_proj x) per head and kv_a_proj
reads [k~ | x] with k~ = k_norm(k_pre_proj x) per KV head: only how a cache row is computed changes,
not how it is read.
Sliding windows (config.sliding_windows): a layer with a window drops the cached rows no query of
the call can see and masks the rest to each query's window (window.py), in every path; one decode
query then reads exactly its window's rows, so the CPU decode kernel runs unchanged. A LatentCache
keeps only a sliding layer's last rows (latent_cache.py): the S rows a call gets are the last S
tokens', and the mask's last S columns are theirs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import MLAConfig
from .kernels.backends import attend_rows
from .latent_cache import cached_rows
from .window import sliding_window


# PyTorch's fused CPU attention (the flash kernel, with its backward) takes values only as wide as the
# keys; narrower values run the unfused math path, which materialises every [T, S] score. From this many
# key rows on, the expanded path pads the values with zeros to the keys' width (benchmarks/results/
# fit_cost.md has the timing that set it).
PAD_VALUES_MIN_ROWS = 512


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """weight * x / rms(x) over the last dim (the RMS in fp32), as the source families' RMSNorms;
    with an offset, (offset + weight) * x / rms(x) all in fp32, cast back last (Gemma's: offset 1)."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (x * (offset + weight.float())).to(dtype)
    return weight * x.to(dtype)


def head_rms_norm(y: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """y [..., heads*d] -> rms_norm of each head's d dims (QK-norm), flat again [..., heads*d]."""
    return rms_norm(y.unflatten(-1, (-1, weight.numel())), weight, eps, offset).flatten(-2)


class MLARMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.offset)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


# The fit's differentiable attention takes its queries this many at a time, each block against the key rows its mask
# lets any of them see (a causal block of sorted queries stops at its last query's row): the keys no query of the
# block sees add exactly nothing to its softmax, so the result is the one product's, in about 1/2 + 1/(2n) of its
# work for n blocks of sorted uniform positions (benchmarks/fit_cost.py --attention-blocks has the timing that set it).
QUERY_BLOCK = 64


def attend_rows_differentiable(q_rows: torch.Tensor, rows: torch.Tensor, d_c: int, softmax_scale: float,
                               mask: torch.Tensor, fold_max_queries: int = 0,
                               values: torch.Tensor | None = None) -> torch.Tensor:
    """attend_rows' result in plain differentiable products (a training loss; fold_max_queries unused): q_rows
    [B, m, H, W] = [q_lat | q_rope] against rows [B, T, W] = [c | k_r] under mask [B|1, 1, m, T] (True = attend;
    each row needs a key) -> o_lat [B, m, H, d_c]. Every head's queries score the same T rows in one product
    [B, m*H, W] x [B, W, T] (q_nope^T W_UK[h] c = (W_UK[h]^T q_nope)^T c), instead of one small attention per head
    over keys expanded to [B, T, H, d_nope + d_v]; QUERY_BLOCK queries at a time, over the span of rows their mask
    reaches. values [B, T, E], when given, are read by the attention weights instead of the latent: [B, m, H, E]."""
    # The scores' product in float32 even under bf16 autocast (as SDPA's flash kernel keeps them): rounded to bf16
    # its error grows with the scores, and the fit's loss reads them. The rows are cast once, so the blocks'
    # gradients sum in float32 and are rounded once, as one product's are.
    wide = torch.promote_types(q_rows.dtype, torch.float32)  # float32, or float64 inputs kept as they are
    with torch.autocast(q_rows.device.type, enabled=False):
        rows_wide = rows.to(wide)  # [B, T, W]
    seen = mask.any(dim=0).any(dim=0)  # [m, T]: keys some batch row of each query sees
    blocks = []
    for start in range(0, q_rows.shape[1], QUERY_BLOCK):
        keys = seen[start : start + QUERY_BLOCK].any(dim=0).nonzero()  # [k, 1]: not empty, each row sees a key
        lo, hi = int(keys[0]), int(keys[-1]) + 1
        blocks.append(_attend_block(q_rows[:, start : start + QUERY_BLOCK], rows_wide[:, lo:hi], rows.dtype, d_c,
                                    softmax_scale, mask[:, :, start : start + QUERY_BLOCK, lo:hi],
                                    None if values is None else values[:, lo:hi]))
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)


def _attend_block(q_rows: torch.Tensor, rows_wide: torch.Tensor, dtype: torch.dtype, d_c: int, softmax_scale: float,
                  mask: torch.Tensor, values: torch.Tensor | None = None) -> torch.Tensor:
    """One block of attend_rows_differentiable: q_rows [B, m, H, W] against rows_wide [B, S, W] (float32 or wider)
    under mask [B|1, 1, m, S] -> o_lat [B, m, H, d_c], read back from the rows in `dtype` (their own); or from
    values [B, S, E] instead: [B, m, H, E]."""
    B, m, H, _ = q_rows.shape
    S = rows_wide.shape[1]
    bias = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, float("-inf"))
    with torch.autocast(q_rows.device.type, enabled=False):
        q = (q_rows.to(rows_wide.dtype) * softmax_scale).reshape(B, m * H, -1)  # [B, m*H, W]
        scores = torch.matmul(q, rows_wide.transpose(1, 2))  # wide [B, m*H, S]
    p = torch.softmax(scores.view(B, m, H, S) + bias.transpose(1, 2), dim=-1)  # wide [B, m, H, S]
    # [B, m*H, d_c] (bf16 under autocast, as it casts)
    read = rows_wide[..., :d_c].to(dtype) if values is None else values.to(dtype)  # [B, S, d_c | E]
    o_lat = torch.matmul(p.view(B, m * H, S).to(dtype), read)
    return o_lat.view(B, m, H, read.shape[-1])


class MLAAttention(nn.Module):
    def __init__(self, config: MLAConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.is_causal = True
        c = config
        H, D = c.num_heads, c.hidden_size
        q_out = H * c.qk_head_dim
        if c.qk_norm:
            d_s = c.qk_norm_head_dim
            self.q_pre_proj = nn.Linear(D, H * d_s, bias=c.qk_norm_bias)
            self.q_norm = MLARMSNorm(d_s, c.rms_norm_eps, c.qk_norm_offset)
            self.k_pre_proj = nn.Linear(D, c.qk_norm_kv_heads * d_s, bias=c.qk_norm_bias)
            self.k_norm = MLARMSNorm(d_s, c.rms_norm_eps, c.qk_norm_offset)
        q_in = c.query_input_size
        if c.q_lora_rank:
            self.q_a_proj = nn.Linear(q_in, c.q_lora_rank, bias=False)
            self.q_a_norm = MLARMSNorm(c.q_lora_rank, c.rms_norm_eps) if c.q_a_norm else None
            self.q_b_proj = nn.Linear(c.q_lora_rank, q_out, bias=c.q_bias)
        else:
            self.q_proj = nn.Linear(q_in, q_out, bias=c.q_bias)
        self.kv_a_proj = nn.Linear(c.kv_input_size, c.kv_lora_rank + c.qk_rope_head_dim, bias=c.kv_a_bias)
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

    def _normed_heads(self, linear: nn.Linear, norm: MLARMSNorm, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, D] -> the source's normed heads norm(linear x) per head, flat [B, T, heads*d_s]."""
        return head_rms_norm(linear(x), norm.weight, norm.eps, norm.offset)  # [B, T, heads*d_s]

    def _query_linear(self, x: torch.Tensor) -> tuple[nn.Linear, torch.Tensor]:
        """The last query linear (q_proj, or q_b_proj after q_a_proj and its norm) and its input."""
        if self.config.qk_norm:
            x = self._normed_heads(self.q_pre_proj, self.q_norm, x)  # [B, T, H*d_s]
        if self.config.q_lora_rank:
            q = self.q_a_proj(x)
            if self.q_a_norm is not None:
                q = self.q_a_norm(q)
            return self.q_b_proj, q
        return self.q_proj, x

    def project_query(self, x: torch.Tensor) -> torch.Tensor:
        linear, x = self._query_linear(x)
        return linear(x)

    def compress(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, D] -> latent c [B, T, d_c] and un-rotated rope key [B, T, d_r]."""
        if self.config.qk_norm:  # the source's normed keys first: [k~ | x] [B, T, g*d_s + D]
            x = torch.cat((self._normed_heads(self.k_pre_proj, self.k_norm, x), x), dim=-1)
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
        past_key_values=None,  # transformers <= 5.23 passes the cache by this name
        position_ids: torch.Tensor | None = None,
        cache=None,  # ... and 5.24 on by this one
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        c = self.config
        if cache is not None:
            past_key_values = cache
        B, T, _ = hidden_states.shape
        if position_ids is None:
            past = past_key_values.get_seq_length(self.layer_idx) if past_key_values is not None else 0
            position_ids = torch.arange(past, past + T, device=hidden_states.device)[None]
        latent, k_rope = self.compress(hidden_states)
        cos, sin = self._rope(position_ids.expand(B, -1), latent.dtype)  # [B, T, d_r]
        k_rope = k_rope * cos + rotate_half(k_rope) * sin

        rows = None  # [B, S, d_c + d_r]: the cached tokens' [c | k_r] (a sliding layer's last ones only)
        if past_key_values is not None:
            rows = cached_rows(past_key_values, self.layer_idx, latent, k_rope)
            latent, k_rope = rows[..., : c.kv_lora_rank], rows[..., c.kv_lora_rank :]  # [B, S, d_c], [B, S, d_r]

        S, device = latent.shape[1], hidden_states.device
        if self._use_absorbed(T, past_key_values is not None):
            if rows is None:
                rows = torch.cat((latent, k_rope), dim=-1)
            # no mask built without padding: the causal limit is the queries' place at the end
            padding = None if attention_mask is None else self._sdpa_mask(attention_mask, T, S, device)
            start, padding = sliding_window(padding, T, S, c.window(self.layer_idx) or S, device)
            rows = rows[:, start:]  # [B, S', d_c + d_r]: the rows the window leaves (a view)
            if self._folds(B, T):
                return self._absorbed_folded(hidden_states, cos, sin, rows, padding), None
            q_nope, q_rope = self._query(hidden_states, cos, sin)
            out = self._absorbed(q_nope, q_rope, rows, padding)
        else:
            q_nope, q_rope = self._query(hidden_states, cos, sin)
            mask = self._sdpa_mask(attention_mask, T, S, device)
            start, mask = sliding_window(mask, T, S, c.window(self.layer_idx) or S, device)
            if start and mask is None:  # one query against its window's rows
                mask = self._sdpa_mask(None, T, S - start, device)
            out = self._expanded(q_nope, q_rope, latent[:, start:], k_rope[:, start:], mask)
        return self.o_proj(out.reshape(B, T, c.num_heads * c.v_head_dim)), None

    def outputs_at(self, hidden_states: torch.Tensor, positions: torch.Tensor,
                   keys_seen: torch.Tensor | None = None) -> torch.Tensor:
        """forward(hidden_states)[0][:, positions]: the output [B, m, D] at the query positions
        `positions` [m] (sorted) of whole sequences hidden_states [B, T, D] at positions 0..T-1, each
        query over its causal window of every key, with the attention and the query and output
        projections computed for those m queries only (a training loss on a sample of the queries
        costs about m / T of the full one's attention). keys_seen [m, T] (True = attend), when given,
        replaces the causal window (each row needs a key). Differentiable, in the absorbed form
        (attend_rows_differentiable); o_proj reads [B, m, H*d_v] as in the forward."""
        c = self.config
        B, m = hidden_states.shape[0], positions.shape[0]
        q_nope, q_rope, rows, mask = self._rows_at(hidden_states, positions, keys_seen)
        out = self._absorbed(q_nope, q_rope, rows, mask, attend=attend_rows_differentiable)  # [B, m, H, d_v]
        return self.o_proj(out.reshape(B, m, c.num_heads * c.v_head_dim))

    def weights_over(self, hidden_states: torch.Tensor, positions: torch.Tensor, values: torch.Tensor,
                     keys_seen: torch.Tensor | None = None) -> torch.Tensor:
        """This attention's weights at the query positions `positions` [m] (as outputs_at) reading other values
        [B, T, E] (one row per key, every head the same rows) instead of its own: [B, m, H, E]. Differentiable;
        a fit's loss holds the scores alone with it (output_fit.FitSettings.scores_weight)."""
        q_nope, q_rope, rows, mask = self._rows_at(hidden_states, positions, keys_seen)
        w_uk, _ = self.up_weights()
        q_lat = torch.einsum("bthn,hnc->bthc", q_nope, w_uk)  # [B, m, H, d_c]
        q_rows = torch.cat((q_lat, q_rope), dim=-1)  # [B, m, H, d_c + d_r]
        return attend_rows_differentiable(q_rows, rows, self.config.kv_lora_rank, self.config.softmax_scale, mask,
                                          values=values)

    def _rows_at(self, hidden_states: torch.Tensor, positions: torch.Tensor, keys_seen: torch.Tensor | None):
        """outputs_at's operands: q_nope [B, m, H, d_nope], rotated q_rope [B, m, H, d_r], the rows [B, T, d_c +
        d_r] and the mask [1, 1, m, T] (True = attend: causal within any window, or keys_seen [m, T])."""
        c = self.config
        B, T, _ = hidden_states.shape
        latent, k_rope = self.compress(hidden_states)  # [B, T, d_c], [B, T, d_r]
        cos, sin = self._rope(torch.arange(T, device=hidden_states.device)[None].expand(B, -1), latent.dtype)
        k_rope = k_rope * cos + rotate_half(k_rope) * sin
        q_nope, q_rope = self._query(hidden_states[:, positions], cos[:, positions], sin[:, positions])
        keys = torch.arange(T, device=hidden_states.device)[None, :]  # [1, T]
        mask = keys <= positions[:, None] if keys_seen is None else keys_seen  # [m, T]
        if c.window(self.layer_idx) and keys_seen is None:
            mask &= keys > positions[:, None] - c.window(self.layer_idx)
        rows = torch.cat((latent, k_rope), dim=-1)  # [B, T, d_c + d_r]
        return q_nope, q_rope, rows, mask[None, None]

    def _query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, D] -> q_nope [B, T, H, d_nope] and the rotated q_rope [B, T, H, d_r]."""
        c = self.config
        B, T, _ = x.shape
        q = self.project_query(x).view(B, T, c.num_heads, c.qk_head_dim)
        q_nope, q_rope = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        q_rope = q_rope * cos[:, :, None] + rotate_half(q_rope) * sin[:, :, None]
        return q_nope, q_rope

    def _use_absorbed(self, q_len: int, has_cache: bool) -> bool:
        """auto: absorbed at inference: decode; on the CPU also prefill, and a pass without a cache when
        the absorbed form does no more multiply-adds per query-key pair than the expanded one
        (W + d_c <= d_qk + d_v: e.g. every compressed SmolLM2 conversion at <= 25%), where the one-KV-head
        form runs in the C prefill kernel or PyTorch's fused SDPA (the expanded one, with values
        narrower than its keys, takes the fused kernel only padded, from PAD_VALUES_MIN_ROWS rows on).
        Expanded for training and for prefill on GPUs."""
        mode = self.config.decode
        if mode != "auto":
            return mode == "absorbed"
        if self.training:
            return False
        if has_cache and q_len <= self.config.absorb_max_query_tokens:
            return True
        if self.kv_a_proj.weight.device.type != "cpu":
            return False
        c = self.config
        return has_cache or 2 * c.kv_lora_rank + c.qk_rope_head_dim <= c.qk_head_dim + c.v_head_dim

    @staticmethod
    def _sdpa_mask(attention_mask, q_len: int, kv_len: int, device) -> torch.Tensor | None:
        """A boolean [B|1, 1, T, S] mask (True = attend), bottom-right causal when none is given;
        None for plain causal attention without a cache offset (SDPA's is_causal, which lets it
        pick its flash / memory-efficient kernels). A given mask's last S columns are the S rows: a
        sliding layer's cache returns its last rows only, and its mask may start before them."""
        if attention_mask is None:
            if q_len == kv_len:
                return None
            offset = kv_len - q_len
            q_pos = torch.arange(q_len, device=device)[:, None] + offset
            return (torch.arange(kv_len, device=device)[None, :] <= q_pos)[None, None]
        mask = attention_mask[..., -q_len:, -kv_len:]  # [B|1, 1, T, S]
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
        d_v = c.v_head_dim
        pad = d_v < c.qk_head_dim and S >= PAD_VALUES_MIN_ROWS and q_nope.shape[1] > 1 and latent.device.type == "cpu"
        if pad:  # zero columns: the first d_v outputs are the same sums, in SDPA's fused CPU kernel
            v = F.pad(v, (0, c.qk_head_dim - d_v))  # [B, S, H, d_qk]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=mask is None,
            scale=c.softmax_scale,
        )  # [B, H, T, d_v] ([B, H, T, d_qk] padded)
        return out.transpose(1, 2)[..., :d_v]  # [B, T, H, d_v]

    def _absorbed(self, q_nope, q_rope, rows, mask, attend=attend_rows) -> torch.Tensor:
        """q_nope [B, T, H, d_nope] and rotated q_rope [B, T, H, d_r] over rows [B, S, d_c + d_r] -> [B, T, H, d_v]:
        W_UK folded into the queries, `attend` (a kernel backend, or attend_rows_differentiable for a loss), W_UV."""
        c = self.config
        w_uk, w_uv = self.up_weights()
        q_lat = torch.einsum("bthn,hnc->bthc", q_nope, w_uk)  # [B, T, H, d_c]
        # The K bias of kv_b_proj adds q_nope . b_k[h] to every score of a query: softmax drops it.
        # MQA with one KV head [c | k_r] in the kernel backend that takes the call (kernels/backends.py)
        q_rows = torch.cat((q_lat, q_rope), dim=-1)  # [B, T, H, d_c + d_r]
        o_lat = attend(q_rows, rows, c.kv_lora_rank, c.softmax_scale, mask,
                       fold_max_queries=c.absorb_max_query_tokens)  # [B, T, H, d_c]
        out = torch.einsum("bthc,hvc->bthv", o_lat, w_uv)  # [B, T, H, d_v]
        if self.kv_b_proj.bias is not None:  # V bias passes through (weights sum to one)
            b_v = self.kv_b_proj.bias.view(c.num_heads, -1)[:, c.qk_nope_head_dim :]
            out = out + b_v
        return out

    # -- prefill in the absorbed form with W_UK and W_UV folded into the projections ---------
    def _folds(self, batch: int, q_len: int) -> bool:
        """Fold W_UK / W_UV into the weights for a prefill-sized call (decode steps keep the per-token
        einsums and their kernel backends): folding costs about what one token per input
        feature costs in einsums, and pays when the folded linears are no wider than the ones they
        replace (d_c <= d_nope, d_c <= d_v: no more work per token, no per-head einsum or concatenation)."""
        c = self.config
        return (q_len > c.absorb_max_query_tokens and batch * q_len >= c.query_input_size and not self.training
                and c.kv_lora_rank <= c.qk_nope_head_dim and c.kv_lora_rank <= c.v_head_dim)

    def _absorbed_folded(self, x, cos, sin, rows, mask) -> torch.Tensor:
        c = self.config
        B, T, _ = x.shape
        H, d_c = c.num_heads, c.kv_lora_rank
        linear, q_in = self._query_linear(x)
        w_q, b_q = self._fold_query(linear)
        q_rows = F.linear(q_in, w_q, b_q).view(B, T, H, d_c + c.qk_rope_head_dim)  # [q_lat | q_rope] per head
        q_rope = q_rows[..., d_c:]  # [B, T, H, d_r], rotated in place
        q_rows[..., d_c:] = q_rope * cos[:, :, None] + rotate_half(q_rope) * sin[:, :, None]
        o_lat = attend_rows(q_rows, rows, d_c, c.softmax_scale, mask,
                            fold_max_queries=c.absorb_max_query_tokens)  # [B, T, H, d_c]
        w_o, b_o = self._fold_output()
        return F.linear(o_lat.reshape(B, T, H * d_c), w_o, b_o)  # [B, T, D]

    def _fold_query(self, linear: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The query linear with W_UK folded in: [H*(d_c + d_r), in] (and bias), rows per head [lat | rope].
        q_lat = W_UK[h]^T q_nope = (W_UK[h]^T W_q,nope[h]) x + W_UK[h]^T b_q,nope[h]."""
        c = self.config
        H, d_n = c.num_heads, c.qk_nope_head_dim
        w_uk = self.up_weights()[0].float()  # [H, d_nope, d_c]
        w = linear.weight.view(H, c.qk_head_dim, -1)  # [H, d_nope + d_r, in]
        w_lat = torch.einsum("hnc,hni->hci", w_uk, w[:, :d_n].float()).to(w.dtype)  # [H, d_c, in]
        weight = torch.cat((w_lat, w[:, d_n:]), dim=1).reshape(-1, w.shape[-1])  # [H*(d_c + d_r), in]
        if linear.bias is None:
            return weight, None
        b = linear.bias.view(H, c.qk_head_dim)  # [H, d_nope + d_r]
        b_lat = torch.einsum("hnc,hn->hc", w_uk, b[:, :d_n].float()).to(b.dtype)  # [H, d_c]
        return weight, torch.cat((b_lat, b[:, d_n:]), dim=1).reshape(-1)

    def _fold_output(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """o_proj with W_UV folded in: [D, H*d_c]; o_proj(W_UV o_lat + b_v) = (W_O W_UV) o_lat + W_O b_v + b_o."""
        c = self.config
        w_uv = self.up_weights()[1].float()  # [H, d_v, d_c]
        w_o = self.o_proj.weight  # [D, H*d_v]
        weight = torch.einsum("dhv,hvc->dhc", w_o.float().view(-1, c.num_heads, c.v_head_dim), w_uv)  # [D, H, d_c]
        bias = None if self.o_proj.bias is None else self.o_proj.bias.float()
        if self.kv_b_proj.bias is not None:
            b_v = self.kv_b_proj.bias.view(c.num_heads, -1)[:, c.qk_nope_head_dim :].reshape(-1)  # [H*d_v]
            bias = w_o.float() @ b_v.float() + (0 if bias is None else bias)
        return weight.reshape(w_o.shape[0], -1).to(w_o.dtype), None if bias is None else bias.to(w_o.dtype)
