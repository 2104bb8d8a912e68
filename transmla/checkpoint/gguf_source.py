"""A GGUF model as a Hugging Face folder: dequantized once, one tensor at a time.

transformers can load a GGUF itself (`from_pretrained(gguf_file=...)`), but it dequantizes the
whole model into memory first (a 1.5B model: 7 GB in fp32). Here the tensors are streamed: each
is dequantized with gguf's own `dequantize`, renamed and (for llama-family q/k) un-permuted by
transformers' GGUF tensor processors, written to the shard writer (which spills it to disk) and
dropped. Peak memory is about one tensor. The values are exactly what transformers would load
(tested on the built-in model).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from ..progress import progress_bar, stderr_console
from .writer import ShardedWriter, atomic_output_dir

# Shards of the dequantized cache stay small enough to be written and read one at a time.
CACHE_SHARD_BYTES = "2GB"


def gguf_metadata(path: Path) -> dict:
    """The GGUF's special-token metadata (ids and add_bos/add_eos)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    meta = {}
    for key in ("bos_token_id", "eos_token_id", "padding_token_id", "unknown_token_id", "add_bos_token", "add_eos_token"):
        field = reader.fields.get(f"tokenizer.ggml.{key}")
        if field is not None and field.data:
            value = field.parts[field.data[0]][0]
            meta[key] = bool(value) if key.startswith("add_") else int(value)
    return meta


def check_gguf_tokenizer(tokenizer, meta: dict) -> list[str]:
    """Make the tokenizer agree with the GGUF's own special-token metadata; return what was fixed."""
    fixes = []
    for attr, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"), ("pad_token_id", "padding_token_id")):
        want = meta.get(key)
        if want is not None and getattr(tokenizer, attr) != want:
            token = tokenizer.convert_ids_to_tokens(want)
            setattr(tokenizer, attr.removesuffix("_id"), token)
            fixes.append(f"{attr} -> {want} ({token})")
    for key in ("add_bos_token", "add_eos_token"):
        if key in meta and getattr(tokenizer, key, meta[key]) != meta[key]:
            setattr(tokenizer, key, meta[key])
            fixes.append(f"{key} -> {meta[key]}")
    return fixes


class GGUFTensors:
    """The weights of a GGUF under a Hugging Face model's names, dequantized one at a time.

    skeleton: the model on the meta device (its names). Uses transformers' own GGUF name map and
    tensor processors (e.g. llama-family q/k un-permutation): the code its
    from_pretrained(gguf_file=...) runs, applied one tensor at a time.
    """

    def __init__(self, gguf: Path, skeleton: torch.nn.Module) -> None:
        from gguf import GGUFReader
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            TensorProcessor,
            get_gguf_hf_weights_map,
            load_gguf_checkpoint,
        )

        self._parsed = {"config": load_gguf_checkpoint(str(gguf), return_tensors=False)["config"]}
        self._reader = GGUFReader(str(gguf))
        arch = bytes(self._reader.fields["general.architecture"].parts[-1]).decode()
        self._processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=self._parsed["config"])
        self._names = get_gguf_hf_weights_map(skeleton, self._processor)

    def __len__(self) -> int:
        return len(self._reader.tensors)

    def load(self, index: int) -> tuple[str, torch.Tensor] | None:
        """(Hugging Face name, fp32 tensor) of the index-th GGUF tensor, or None if the model has no use for it."""
        from gguf import dequantize

        tensor = self._reader.tensors[index]
        weights = _dequantize_rows(tensor.data, tensor.tensor_type, dequantize)
        _drop_mapped_pages(self._reader)
        result = self._processor.process(
            weights=weights, name=tensor.name, tensor_key_mapping=self._names, parsed_parameters=self._parsed
        )
        if result.name not in self._names:
            return None
        return self._names[result.name], torch.from_numpy(np.require(result.weights, np.float32, ["C", "W"]))  # copied only if read-only


# Rows dequantized at a time: gguf's dequantizers make several temporaries the size of their
# input, so a whole embedding (151936 x 1536) would briefly cost a few GB.
_CHUNK_VALUES = 2**22


def _dequantize_rows(data: np.ndarray, qtype, dequantize) -> np.ndarray:
    """gguf's dequantize(data, qtype), a block of rows at a time, into one fp32 array."""
    rows = data.reshape(-1, data.shape[-1]) if data.ndim > 1 else data.reshape(1, -1)  # [n, bytes per row]
    first = dequantize(rows[:1], qtype)  # [1, values per row]
    out = np.empty((rows.shape[0], first.shape[-1]), dtype=np.float32)
    step = max(1, _CHUNK_VALUES // first.shape[-1])
    for start in range(0, rows.shape[0], step):
        out[start : start + step] = dequantize(rows[start : start + step], qtype)
    return out.reshape(*data.shape[:-1], first.shape[-1]) if data.ndim > 1 else out.reshape(-1)


def _drop_mapped_pages(reader) -> None:
    """Let the kernel drop the file pages read so far: they would otherwise stay mapped and count
    as resident memory until the whole GGUF had been read (they are re-read on demand)."""
    import mmap

    mapped = getattr(reader.data, "_mmap", None)
    if mapped is not None and hasattr(mmap, "MADV_DONTNEED"):
        mapped.madvise(mmap.MADV_DONTNEED)


def gguf_to_hf(gguf: Path, target: Path) -> Path:
    """Dequantize a GGUF file into a Hugging Face folder (fp32 safetensors) at `target`, once."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    if (target / "config.json").is_file():
        return target
    stderr_console.print(f"[dim]dequantizing {gguf.name} once into {target}, one tensor at a time...[/dim]")
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config  # dequantized: a plain fp32 checkpoint from here on
    config.dtype = torch.float32
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    expected = set(skeleton.state_dict())
    if getattr(config, "tie_word_embeddings", False):
        expected.discard("lm_head.weight")  # tied to the embeddings, as transformers saves it
    with atomic_output_dir(target, force=True) as tmp:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        fixes = check_gguf_tokenizer(tokenizer, gguf_metadata(gguf))
        tokenizer.save_pretrained(tmp)
        del tokenizer  # a large vocabulary's tokenizer is not kept while the weights stream
        config.save_pretrained(tmp)
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
        (tmp / "transmla_source.json").write_text(json.dumps({"gguf": str(gguf), "tokenizer_fixes": fixes}, indent=1))
        source = GGUFTensors(gguf, skeleton)
        written = set()
        with ShardedWriter(tmp, CACHE_SHARD_BYTES) as writer:
            # Progress over indices: a wrapper holding the previous tensor would double the peak.
            for index in progress_bar(range(len(source)), "dequantizing tensors"):
                item = source.load(index)
                if item is not None:
                    writer.add(*item)
                    written.add(item[0])
                del item
            missing = sorted(expected - written)
            if missing:
                raise ValueError(f"{gguf.name}: no tensor for {missing[0]} (and {len(missing) - 1} more) of the {config.model_type} model")
    return target


__all__ = ["CACHE_SHARD_BYTES", "GGUFTensors", "check_gguf_tokenizer", "gguf_metadata", "gguf_to_hf"]
