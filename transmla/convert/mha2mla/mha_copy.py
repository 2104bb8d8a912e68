"""An MHA copy of a GQA checkpoint: every key/value head repeated for its query group.

GQA head h reads key/value head h // n (n = H/g). Repeating rows of k_proj/v_proj (and their
biases) n times per head gives H key/value heads with k_h = k_(h//n): every attention score and
output is unchanged, so the MHA model computes the same function with a cache n times larger.
Used to study MHA2MLA on an MHA source (the method the paper targets) built from the same model.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...checkpoint.files import copy_tokenizer_files
from ...checkpoint.reader import SafetensorsReader
from ...checkpoint.writer import ShardedWriter, atomic_output_dir
from ...families import attention_geometry, family_for


def repeat_kv_heads(w: torch.Tensor, num_kv_heads: int, group_size: int) -> torch.Tensor:
    """[g*d, ...] -> [g*n*d, ...]: head j's d rows repeated n times in place (heads j*n .. j*n+n-1)."""
    d = w.shape[0] // num_kv_heads
    heads = w.reshape(num_kv_heads, d, *w.shape[1:])
    return heads.repeat_interleave(group_size, dim=0).reshape(num_kv_heads * group_size * d, *w.shape[1:])


def make_mha_copy(source_dir: str | Path, out_dir: str | Path, force: bool = False, max_shard_size: str = "5GB") -> Path:
    """Write the MHA copy of the GQA checkpoint in `source_dir` to `out_dir` (a real HF folder)."""
    from transformers import AutoConfig

    source_dir, out_dir = Path(source_dir), Path(out_dir)
    config = AutoConfig.from_pretrained(source_dir)
    family = family_for(config)
    geo = attention_geometry(config)
    g, n = geo.num_kv_heads, geo.group_size
    repeated = {}
    for i in range(geo.num_layers):
        names = family.attention_names(config, i)
        for role in ("k", "v", "k_bias", "v_bias"):
            if role in names:
                repeated[names[role]] = role
    with SafetensorsReader(source_dir) as reader, atomic_output_dir(out_dir, force=force) as tmp:
        writer = ShardedWriter(tmp, max_shard_size)
        for name in reader.keys():
            t = reader.get(name)
            writer.add(name, repeat_kv_heads(t, g, n) if name in repeated else t)
        writer.close()
        config.num_key_value_heads = geo.num_heads
        if getattr(config, "head_dim", None) is None and hasattr(config, "head_dim"):
            config.head_dim = geo.head_dim
        config.save_pretrained(tmp)
        copy_tokenizer_files(source_dir, tmp)
        for extra in ("transmla_source.json",):
            if (source_dir / extra).is_file():
                (tmp / extra).write_bytes((source_dir / extra).read_bytes())
    return out_dir
