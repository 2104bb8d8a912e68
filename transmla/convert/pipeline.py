"""Stream a source checkpoint through a per-layer conversion into a native MLA checkpoint.

One layer's attention tensors are read, converted and written at a time; every other tensor is
copied through unchanged (cast to the output dtype). Output appears only when complete.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint.files import copy_tokenizer_files
from ..checkpoint.reader import SafetensorsReader
from ..checkpoint.writer import ShardedWriter, atomic_output_dir
from ..dtypes import torch_dtype
from ..families import attention_geometry, family_for, rope_inv_freq
from ..mla.config import MLAConfig
from ..mla.model import mla_config_for
from ..progress import progress_bar
from .layers import MLALayer, SourceAttention


@dataclass
class ConvertResult:
    output: str
    method: str
    num_layers: int
    mla: dict
    source_kv_elements_per_token_per_layer: int
    kv_elements_per_token_per_layer: int
    files: list[str] = field(default_factory=list)

    @property
    def cache_ratio(self) -> float:
        return self.kv_elements_per_token_per_layer / self.source_kv_elements_per_token_per_layer


def read_source_attention(reader: SafetensorsReader, config, layer: int) -> SourceAttention:
    family = family_for(config)
    names = family.attention_names(config, layer)
    missing = [n for n in names.values() if n not in reader]
    if missing:
        raise KeyError(f"source checkpoint lacks {missing[0]} (layer {layer})")
    inv_freq, _ = rope_inv_freq(config)
    return SourceAttention.from_tensors(attention_geometry(config), inv_freq, {r: reader.get(n) for r, n in names.items()})


def source_layers(source_dir: Path, config) -> Iterator[SourceAttention]:
    """Each layer's source attention, read one layer at a time."""
    with SafetensorsReader(source_dir) as reader:
        for i in range(attention_geometry(config).num_layers):
            yield read_source_attention(reader, config, i)


def _shape_signature(layer: MLALayer) -> dict[str, tuple | None]:
    return {k: (None if v is None else tuple(v.shape)) for k, v in layer.__dict__.items()}


def _mla_config(config, first: MLALayer, inv_freqs: list[list[float]], method: dict) -> MLAConfig:
    geo = attention_geometry(config)
    d_r = 2 * first.rope_inv_freq.numel()
    d_c = first.kv_a_proj.shape[0] - d_r
    H = geo.num_heads
    q_out = (first.q_b_proj if first.q_a_proj is not None else first.q_proj).shape[0]
    _, scaling = rope_inv_freq(config)
    return MLAConfig(
        num_heads=H,
        hidden_size=geo.hidden_size,
        kv_lora_rank=d_c,
        qk_rope_head_dim=d_r,
        qk_nope_head_dim=q_out // H - d_r,
        v_head_dim=first.o_proj.shape[1] // H,
        softmax_scale=geo.head_dim**-0.5,  # the source's scale, kept exactly
        rope_inv_freq=inv_freqs,
        rope_attention_scaling=scaling,
        q_lora_rank=None if first.q_a_proj is None else first.q_a_proj.shape[0],
        kv_a_norm=first.kv_a_norm is not None,
        q_bias=first.q_bias is not None,
        kv_a_bias=first.kv_a_bias is not None,
        kv_b_bias=first.kv_b_bias is not None,
        o_bias=first.o_bias is not None,
        rms_norm_eps=getattr(config, "rms_norm_eps", 1e-6),
        source={
            "model_type": config.model_type,
            "num_key_value_heads": geo.num_kv_heads,
            "head_dim": geo.head_dim,
            "kv_elements_per_token_per_layer": geo.kv_elements_per_token_per_layer,
        },
        method=method,
    )


def write_mla_checkpoint(
    source_dir: Path,
    config,
    output: Path,
    layers: Iterable[MLALayer],
    method: dict,
    dtype: str | None = None,
    max_shard_size: str | int = "5GB",
    force: bool = False,
    progress: bool = True,
) -> ConvertResult:
    """Write the checkpoint in `source_dir` with its attention replaced by `layers` (one per layer, in order).

    `layers` is consumed lazily, so a method may read, calibrate and convert one layer at a time.
    """
    family = family_for(config)
    geo = attention_geometry(config)
    out_dtype = torch_dtype(dtype) if dtype else None
    with SafetensorsReader(source_dir) as reader, atomic_output_dir(output, force=force) as tmp:
        writer = ShardedWriter(tmp, max_shard_size)
        attention_names = {n for i in range(geo.num_layers) for n in family.attention_names(config, i).values()}
        src_dtype = reader.dtype_of(family.attention_names(config, 0)["q"])
        cast = lambda t: t.to(out_dtype or src_dtype) if t.is_floating_point() else t  # noqa: E731
        for name in reader.keys():
            if name not in attention_names:
                writer.add(name, cast(reader.get(name)))
        first, inv_freqs = None, []  # only layer 0's shapes and each layer's frequencies are kept
        count = 0
        for i, layer in enumerate(progress_bar(layers, "converting layers", enabled=progress, total=geo.num_layers)):
            count += 1
            if first is None:
                first = layer
            elif _shape_signature(layer) != _shape_signature(first):
                raise ValueError(f"layer {i} converted to different shapes than layer 0")
            inv_freqs.append(layer.rope_inv_freq.tolist())
            for name, tensor in layer.state_dict(family.attention_prefix(i)).items():
                writer.add(name, cast(tensor))
        if count != geo.num_layers:
            raise ValueError(f"the method produced {count} layers for a {geo.num_layers}-layer model")
        files = writer.close()
        mla = _mla_config(config, first, inv_freqs, method)
        out_config = mla_config_for(config, mla)
        out_config.dtype = out_dtype or src_dtype
        out_config.save_pretrained(tmp)
        copy_tokenizer_files(source_dir, tmp)
    return ConvertResult(
        output=str(output),
        method=method.get("name", "?"),
        num_layers=geo.num_layers,
        mla=mla.to_dict(),
        source_kv_elements_per_token_per_layer=geo.kv_elements_per_token_per_layer,
        kv_elements_per_token_per_layer=mla.kv_elements_per_token_per_layer,
        files=files,
    )
