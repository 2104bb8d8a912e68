"""Calibration statistics, streamed one decoder layer at a time.

Only the current layer's weights and the calibration tokens' hidden states are held. Every
second moment the methods need is linear-algebra on one small matrix per layer: with
x the attention input (after the layer's input norm) and x_a = [x; 1], the key, value and
query maps are linear in x_a, so E[(W x + b)(W x + b)^T] = [W b] E[x_a x_a^T] [W b]^T.
The per-pair norm means (MHA2MLA's 2-norm score) are not second moments and are
accumulated token by token when asked for. For a QK-norm source x is replaced by u = [q~; k~; x]
(qk_norm.py), over which its maps are linear: the same holds with the gram of [u; 1].
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..checkpoint.finite import require_finite
from ..checkpoint.reader import SafetensorsReader
from ..families import attention_geometry, family_for
from ..mla.attention import MLAAttention
from ..progress import progress_bar
from .layers import MLALayer, SourceAttention, read_source_attention
from .assemble import mla_config
from .options import PROPAGATIONS
from .qk_norm import linear_source, source_inputs
from ..mla.window import sliding_window



# Tokens per forward pass of a stream through a layer: the MLP's intermediates of a pass ([n, I] each, a few
# alive at once) are the largest transients of the calibration (Qwen2.5-1.5B's I = 8960: 300 MB each at 8192).
BATCH_TOKENS = 2048


@dataclass
class LayerStats:
    gram: torch.Tensor  # [D+1, D+1] float64, mean over tokens of x_a x_a^T (of [u; 1] for QK-norm)
    tokens: int
    q_pair_norm: torch.Tensor | None = None  # [H, d/2] mean 2-norm of each query head's pair
    k_pair_norm: torch.Tensor | None = None  # [g, d/2]


class _StatsAccumulator:
    def __init__(self, src: SourceAttention, pair_norms: bool, device) -> None:
        self.source, self.src, self.pair_norms = src, linear_source(src), pair_norms
        D = self.src.wq.shape[1]  # the width of x, or of u for a QK-norm source
        self.gram = torch.zeros(D + 1, D + 1, dtype=torch.float64, device=device)
        self.tokens = 0
        g = src.geometry
        self.q_norm = torch.zeros(g.num_heads, g.head_dim // 2, dtype=torch.float64, device=device)
        self.k_norm = torch.zeros(g.num_kv_heads, g.head_dim // 2, dtype=torch.float64, device=device)

    def add(self, x: torch.Tensor) -> None:
        x = source_inputs(self.source, x.reshape(-1, x.shape[-1]))  # [n, D] (u: [n, H*d + g*d + D])
        xa = torch.cat((x, x.new_ones(x.shape[0], 1)), dim=1).double()  # [n, D+1]
        self.gram += xa.T @ xa
        self.tokens += x.shape[0]
        if self.pair_norms:
            src, d = self.src, self.src.geometry.head_dim
            for w, b, acc in ((src.wq, src.bq, self.q_norm), (src.wk, src.bk, self.k_norm)):
                y = F.linear(x, w.to(x), None if b is None else b.to(x)).view(x.shape[0], -1, d)  # [n, heads, d]
                acc += torch.sqrt(y[..., : d // 2] ** 2 + y[..., d // 2 :] ** 2).sum(0).double()  # [heads, d/2]

    def result(self) -> LayerStats:
        n = max(self.tokens, 1)
        return LayerStats(
            gram=(self.gram / n).cpu(),
            tokens=self.tokens,
            q_pair_norm=(self.q_norm / n).cpu() if self.pair_norms else None,
            k_pair_norm=(self.k_norm / n).cpu() if self.pair_norms else None,
        )


def _rope_cos_sin(config, layer: int, seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The source layer's full-head cos/sin [1, T, d], as its rotary embedding computes them."""
    inv_freq, scale = family_for(config).rope(config, layer)
    freqs = torch.arange(seq_len, device=device).float()[:, None] * inv_freq.to(device)[None]  # [T, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)[None]
    return emb.cos() * scale, emb.sin() * scale


def _layer_mask(config, layer: int, seq_len: int, device) -> torch.Tensor | None:
    """The source layer's attention mask over a whole sequence: None (causal) or, for a sliding-window
    layer shorter than the sequence, the bool band [1, 1, T, T] (True = attend)."""
    window = family_for(config).window(config, layer)
    return None if not window else sliding_window(None, seq_len, seq_len, window, device)[1]


def _load_decoder_layer(reader: SafetensorsReader, config, layer: int, device):
    family = family_for(config)
    root = family.layer_root.format(i=layer)
    tensors = {k[len(root):]: reader.get(k).float() for k in reader.keys() if k.startswith(root)}
    module = family.decoder_layer(config, layer)
    module.load_state_dict(family.layer_state_dict(tensors), strict=True)
    return module.float().to(device).eval()


def mla_attention(config, layer: MLALayer, device, index: int = 0) -> MLAAttention:
    """A standalone MLAAttention holding one converted layer, source layer `index` (its frequencies
    and window at index 0), in the expanded form: the output fit reads o_proj's input and trains
    through it."""
    mla = mla_config(config, layer, [layer.rope_inv_freq.tolist()], {}, source_layers=[index])
    mla.decode = "expanded"
    attn = MLAAttention(mla, 0)
    attn.load_state_dict({k: v.float() for k, v in layer.state_dict("").items()}, strict=True)
    return attn.to(device).eval()


def calibrated_layers(
    source_dir: Path,
    config,
    calib_ids: torch.Tensor,
    convert_layer: Callable[[int, SourceAttention, LayerStats], MLALayer],
    *,
    propagate: str = "original",
    fit_ids: torch.Tensor | None = None,
    fit_layer: Callable[[int, MLALayer, torch.Tensor, torch.Tensor], MLALayer] | None = None,
    pair_norms: bool = False,
    device: str = "cpu",
    batch_tokens: int = BATCH_TOKENS,
    progress: bool = True,
    bf16: bool = False,
) -> Iterator[MLALayer]:
    """Calibrate and convert layer by layer; yields each converted layer in order.

    calib_ids [N, T]. propagate: the hidden states fed to layer i+1 come from the original
    layer i ("original") or from its converted MLA form ("converted"); "corrected" keeps the statistics
    on the original model and gives the fit two copies of its sequences: the converted model's hidden
    states as the input x and the original model's attention output as the target z, so that each
    layer's fit also undoes what the layers converted before it changed in its input (attend, the far
    term's source attention, then reads the converted input).
    fit_ids [N', T'] and fit_layer: after converting layer i, fit_layer(i, layer, x, z, attend) returns the
    layer to keep, x [N', T', D] being the attention input of the fit sequences (propagated like the
    calibration tokens), z the source attention's output on x and attend(x, mask) the source attention
    under another mask (output_fit.py). It runs outside
    inference mode (it may train), on float32 copies.
    batch_tokens: tokens per forward pass of a stream (whole sequences, at least one).
    bf16: the source layers' forward passes (the streams' propagation and the fit's x and z) under bf16 autocast
    (the residual stream, norms and statistics stay float32): where bf16 products pay (dtypes.fast_bf16_matmul).
    The fit's x and z are then held in bfloat16 (fit_storage_dtype): half their memory, the largest tensors of a
    conversion after the residual streams, and the same fit.
    """
    if propagate not in PROPAGATIONS:
        raise ValueError(f"propagate must be one of {PROPAGATIONS}, got {propagate!r}")
    family = family_for(config)
    config = copy.deepcopy(config)
    config._attn_implementation = "sdpa"
    if hasattr(config, "_experts_implementation"):
        config._experts_implementation = "eager"  # a standalone MoE layer has no dispatch otherwise
    geo = attention_geometry(config)
    with torch.inference_mode(), SafetensorsReader(source_dir) as reader:
        embed = reader.get(family.embed_name).float().to(device)  # [V, D], read once for every stream
        embed_scale = torch.tensor(family.embedding_scale(config), dtype=embed.dtype)  # as the source casts it
        streams = []  # (hidden [N, T, D], position_ids): the calibration sequences, then the fit's
        fit_streams = (2 if propagate == "corrected" else 1) if fit_layer is not None else 0
        for token_ids in [calib_ids] + [fit_ids] * fit_streams:  # calibration, fit (original), fit (converted)
            token_ids = token_ids.to(device)
            position_ids = torch.arange(token_ids.shape[1], device=device)[None]
            streams.append((F.embedding(token_ids, embed).mul_(embed_scale.to(device)), position_ids))  # in place: one copy
        del embed
        hidden = streams[0][0]  # the statistics' stream
        store = fit_storage_dtype(bf16)  # the fit's x and z
        for i in progress_bar(range(geo.num_layers), "calibrating layers", enabled=progress):
            layer = _load_decoder_layer(reader, config, i, device)
            src = read_source_attention(reader, config, i)
            acc = _StatsAccumulator(src, pair_norms, device)
            batch_size = _sequences(hidden, batch_tokens)
            for start in range(0, hidden.shape[0], batch_size):
                acc.add(layer.input_layernorm(hidden[start : start + batch_size]))
            stats = acc.result()
            require_finite(stats.gram, f"layer {i}'s calibration statistics")
            converted = convert_layer(i, src, stats)
            views = [(_rope_cos_sin(config, i, h.shape[1], device), _layer_mask(config, i, h.shape[1], device)) for h, _ in streams]
            if fit_layer is not None and propagate == "converted":  # the source attention's io before it is replaced
                with _autocast(device, bf16):
                    x, z = _source_attention_io(layer, streams[1][0], *views[1], streams[1][1],
                                                _sequences(streams[1][0], batch_tokens), store)
                with torch.inference_mode(False):
                    converted = fit_layer(i, converted, x, z, _masked_attention(layer, views[1][0], streams[1][1], src))
                del x, z
                layer.self_attn = mla_attention(config, converted, device, i)
            fit_x = fit_z = None  # the fit's x and z [N', T', D], filled batch by batch while the fit stream passes
            for k, ((h_all, h_pos), (cos_sin, mask)) in enumerate(zip(streams, views)):
                batch_size = _sequences(h_all, batch_tokens)
                if k == 2:  # corrected: the fit's converted stream, through the fitted layer (the original's are past)
                    x = _filled(h_all, batch_size, lambda s: layer.input_layernorm(h_all[s : s + batch_size]), store)
                    with torch.inference_mode(False):
                        converted = fit_layer(i, converted, x, fit_z, _masked_attention(layer, cos_sin, h_pos, src))
                    del x
                    fit_z = None
                    layer.self_attn = mla_attention(config, converted, device, i)
                # with original propagation the fit's x and z are what the source layer's attention reads and
                # writes while the fit stream passes: kept, not computed again (corrected: z only)
                keep = fit_layer is not None and propagate in ("original", "corrected") and k == 1
                hook = None
                if keep:
                    fit_z = _buffer(h_all, store)
                    fit_x = _buffer(h_all, store) if propagate == "original" else None
                    hook = layer.self_attn.register_forward_hook(_writer(fit_x, fit_z), with_kwargs=True)
                for start in range(0, h_all.shape[0], batch_size):
                    h = h_all[start : start + batch_size]
                    with _autocast(device, bf16):
                        out = layer(h, attention_mask=mask, position_ids=h_pos, position_embeddings=cos_sin)
                    h_all[start : start + batch_size] = out[0] if isinstance(out, tuple) else out
                if hook is not None:
                    hook.remove()
            if fit_x is not None:
                with torch.inference_mode(False):
                    converted = fit_layer(i, converted, fit_x, fit_z, _masked_attention(layer, views[1][0], streams[1][1], src))
                del fit_x, fit_z
            yield converted
            del layer


def fit_storage_dtype(bf16: bool) -> torch.dtype:
    """The dtype the fit's x and z are held in: bfloat16 when the source passes run under bf16 autocast, else
    float32. Exact then: z is the source attention's o_proj output, already bf16 under autocast, and x (the input
    norm's float32 output) is read only by linears under autocast, which round it to bf16 as storing it does (both
    round to nearest even); the fit's Adam, closed forms and far targets all run under autocast with bf16 passes
    (output_fit.FitSettings.bf16_passes, which implies its Adam's bf16)."""
    return torch.bfloat16 if bf16 else torch.float32


def _autocast(device: str, bf16: bool):
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16)


def _sequences(hidden: torch.Tensor, batch_tokens: int) -> int:
    """Sequences of hidden [N, T, D] per forward pass: batch_tokens // T, at least one."""
    return max(1, batch_tokens // hidden.shape[1])


def _buffer(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An empty `dtype` tensor shaped like `like`, made outside inference mode: the fit may train on it. Filled in
    place while the stream passes, it holds the fit's sequences once, not as batches and their concatenation."""
    with torch.inference_mode(False):
        return torch.empty(like.shape, dtype=dtype, device=like.device)


def _writer(x: torch.Tensor | None, z: torch.Tensor):
    """A forward hook (with kwargs) on a source attention that copies its input hidden states into x (unless
    None) and its output into z, batch after batch, from row 0."""
    row = [0]

    def hook(module, args, kwargs, out):
        start, stop = row[0], row[0] + out[0].shape[0]
        if x is not None:
            x[start:stop].copy_(kwargs["hidden_states"])
        z[start:stop].copy_(out[0])
        row[0] = stop

    return hook


def _filled(like: torch.Tensor, batch_size: int, batch, dtype: torch.dtype) -> torch.Tensor:
    """A `dtype` _buffer shaped like `like`, filled with batch(start) [b, ...] for start = 0, batch_size, ..."""
    out = _buffer(like, dtype)
    for start in range(0, like.shape[0], batch_size):
        out[start : start + batch_size].copy_(batch(start))
    return out


class MaskedSourceAttention:
    """The source layer's attention on its input x [n, T, D] under a given mask [1, 1, T, T] (bool, True = attend),
    and its tensors (`source`, a SourceAttention: the values a fit's scores term reads). A class, not a closure: a
    fit in a worker process (pipeline.LayerStream, fit_jobs) receives it pickled."""

    def __init__(self, attention, cos_sin, position_ids, source: SourceAttention | None = None) -> None:
        self.attention, self.cos_sin, self.position_ids, self.source = attention, cos_sin, position_ids, source

    def __call__(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode(False), torch.no_grad():
            return self.attention(x, position_embeddings=self.cos_sin, attention_mask=mask,
                                  position_ids=self.position_ids)[0]


def _masked_attention(layer, cos_sin, position_ids, source: SourceAttention) -> MaskedSourceAttention:
    return MaskedSourceAttention(layer.self_attn, cos_sin, position_ids, source)


def _source_attention_io(layer, hidden, cos_sin, mask, position_ids, batch_size: int,
                         dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x = input_layernorm(hidden) [N, T, D] and the source attention's output on x [N, T, D] (`dtype` _buffers)."""
    x = _filled(hidden, batch_size, lambda s: layer.input_layernorm(hidden[s : s + batch_size]), dtype)
    z = _filled(x, batch_size, lambda s: layer.self_attn(x[s : s + batch_size], position_embeddings=cos_sin,
                                                          attention_mask=mask, position_ids=position_ids)[0], dtype)
    return x, z


def collect_layer_stats(
    source_dir: Path, config, calib_ids: torch.Tensor, *, pair_norms: bool = False, device: str = "cpu",
    progress: bool = True,
) -> list[LayerStats]:
    """Every layer's statistics under "original" propagation (small: (D+1)^2 per layer)."""
    stats: list[LayerStats] = []

    def keep(i, src, s):
        stats.append(s)
        from .replicate import replicate

        return replicate(src)

    for _ in calibrated_layers(
        source_dir, config, calib_ids, keep, pair_norms=pair_norms, device=device, progress=progress
    ):
        pass
    return stats
