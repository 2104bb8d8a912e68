"""GGUF export: a DeepSeek-V3 config + tensor stream as a llama.cpp `deepseek2` GGUF.

llama.cpp runs DeepSeek's MLA with the absorbed latent cache (K cache = [c; k_rope] per token per
layer, V a view of it). What its loader requires, read from llama.cpp's src/models/deepseek2.cpp
and convert_hf_to_gguf.py (DeepseekV2Model) in the llama-cpp-python 0.3.36 sdist:

- q_lora_rank is a required key unless the layer count is one of DeepSeek-V2-Lite's: write 0 for
  a plain q_proj (`attn_q`); kv_lora_rank, the MLA head sizes (key_length_mla = d_nope + d_r,
  value_length_mla = d_v; key_length = d_c + d_r and value_length = d_c are the cache widths),
  expert_feed_forward_length and expert_shared_count are required even for a dense model;
  leading_dense_block_count = the layer count makes every FFN dense (no expert tensors then).
- kv_b_proj [H*(d_nope+d_v), d_c] is stored split: attn_k_b [H, d_c, d_nope] (transposed, the
  absorbed query side) and attn_v_b [H, d_v, d_c].
- RoPE is GGML's "normal" mode: rotates adjacent pairs (2i, 2i+1) at theta^(-2i/d_r), which is
  DeepSeek's rope_interleave; the rows pass unchanged (a rotate-half config is re-interleaved).
  No per-dimension frequency factors are read for deepseek2, so llama3/longrope scaling cannot
  be represented; yarn is not written here yet (refused).
- Softmax scale: 1/sqrt(d_nope + d_r), as in DeepSeek (the DeepSeek export folds ours into q).
- No attention or MLP biases exist in the graph: refused. Neither is qk_nope_head_dim 0 (every
  key dim rotated, e.g. the lossless conversion): llama.cpp asserts at least one.

ik_llama.cpp (the fork with MLA modes -mla 1/2/3 and CPU flash MLA) reads the same architecture
with a stricter loader (src/llama-hparams.cpp, src/llama-load-tensors.cpp create_deepseek2_tensors
and src/llama-build-context.cpp build_deepseek2 in the ik-llama-cpp-python 0.1.5 sdist); `IK`
writes its conventions, `MAINLINE` llama.cpp's:

- head_count_kv = n_head, key_length = d_nope + d_r, value_length = d_v (a file with
  head_count_kv 1 is refused unless it is DeepSeek's own 576/512 with rope 64); kq_scale is
  1/sqrt(key_length), rope dimension_count = d_r; the cache is still [k_rope; c] per token.
- attn_kv_b whole ([H*(d_nope+d_v), d_c]: its prompt path decompresses the cache with it) and
  attn_k_b/attn_v_b as 2-D matrices ([H*d_c, d_nope], [H*d_v, d_c]). ik would derive these two at load
  (llm_prepare_mla), but that step's ggml context is sized from the tensors alone and overflows
  (a crash in ggml_new_tensor) for small latents with many layers, e.g. 26 layers of latent 32.
- Every layer count other than 26/27 (DeepSeek-V2-Lite's) needs attn_q_a/attn_q_a_norm/attn_q_b:
  a plain q_proj W_q is written as q_a = s I (D x D), q_a_norm = sqrt(eps)/s, q_b = W_q, the
  latent-norm trick of the DeepSeek export (deepseek_layer.norm_trick_scale): the norm returns
  x / sqrt(1 + s^2 mean(x^2) / eps), a relative error <= 5e-10. A 26/27-layer model must have a
  plain q_proj (and a 48-layer one with a 128256 vocabulary is refused: its hparams skip
  q_lora_rank while its tensor loader expects q_a). `IK_PLAIN_QUERY` (`--plain-query`) writes a plain
  attn_q instead, for ik built with tools/ik_llama_cpp/plain-query.patch (it loads one whenever
  q_lora_rank is 0): one matrix less per layer, which stock ik refuses.
- output.weight is required (tied embeddings are written untied), and so is expert_weights_scale
  (written 1.0; a dense model has no experts).

Weight types: f32, bf16 or q8_0 for matrices (norms are always f32). The latent rows of
attn_kv_a_mqa and a norm-trick attn_q_a are scaled by a tiny power of two (the latent-norm no-op
of the DeepSeek export); Q8_0's fp16 block scales would underflow, so those tensors stay f32 (f32)
or bf16 (otherwise). Q8_0 needs rows of a multiple of 32 values; other matrices fall back to bf16.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import gguf
import numpy as np
import torch

from .deepseek_layer import norm_trick_scale
from .errors import ExportError
from .gguf_vocab import add_vocab

GGUF_TYPES = ("f32", "bf16", "q8_0")
ARCH = "deepseek2"
Q = gguf.GGMLQuantizationType
FILE_TYPES = {"f32": gguf.LlamaFileType.ALL_F32, "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
MATRIX_TYPES = {"f32": Q.F32, "bf16": Q.BF16, "q8_0": Q.Q8_0}

GLOBAL_TENSORS = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_TENSORS = {  # DeepseekV3ForCausalLM name after "model.layers.N." -> GGUF name after "blk.N."
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.kv_b_proj.weight": None,  # split into attn_k_b / attn_v_b
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
SCALED = ("attn_kv_a_mqa.weight", "attn_q_a.weight")  # tiny-scaled rows: never Q8_0 (see the module notes)


@dataclass(frozen=True)
class GGUFEngine:
    """Which llama.cpp reads the deepseek2 file: the conventions of its loader (module notes)."""

    name: str
    heads_kv: bool  # head_count_kv = n_head, key/value_length = the per-head sizes (ik), else the cache widths
    whole_kv_b: bool  # attn_kv_b as well (ik), beside attn_k_b/attn_v_b (ik: as 2-D matrices)
    full_rank_q: bool  # a plain q_proj goes through attn_q_a/attn_q_a_norm/attn_q_b (ik, except 26/27 layers)
    untie: bool  # output.weight always written
    lite_layers: tuple[int, ...] = ()  # layer counts its loader takes as DeepSeek-V2-Lite: a plain attn_q only


IK_LITE_LAYERS = (26, 27)  # ik_llama.cpp loads these as DeepSeek-V2-Lite: a plain attn_q, no q_a
MAINLINE = GGUFEngine("llama.cpp", heads_kv=False, whole_kv_b=False, full_rank_q=False, untie=False)
IK = GGUFEngine("ik_llama.cpp", heads_kv=True, whole_kv_b=True, full_rank_q=True, untie=True, lite_layers=IK_LITE_LAYERS)
# ik built with tools/ik_llama_cpp/plain-query.patch (`make ik-llama-cpp-patched`): q_lora_rank 0 loads a plain
# attn_q at any layer count (`--plain-query`); stock ik refuses such a file unless it has 26 or 27 layers
IK_PLAIN_QUERY = replace(IK, name="ik_llama.cpp (plain-query patch)", full_rank_q=False)
ENGINES = {e.name: e for e in (MAINLINE, IK, IK_PLAIN_QUERY)}


@dataclass(frozen=True)
class DeepseekShape:
    """The dimensions a deepseek2 GGUF is written from (read from a DeepSeek-V3 config.json)."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    vocab_size: int
    d_nope: int
    d_rope: int
    d_v: int
    d_c: int
    q_lora_rank: int  # 0: a plain q_proj
    rope_theta: float
    rope_interleave: bool
    rms_norm_eps: float
    max_positions: int
    tied_embeddings: bool

    full_rank_q: bool = False  # a plain q_proj written as a full-rank norm-trick q_a path (IK)

    @property
    def q_rank_written(self) -> int:
        """q_lora_rank in the file: the model's, the hidden size for a full-rank q_a path, else 0."""
        return self.hidden_size if self.full_rank_q else self.q_lora_rank

    @property
    def cache_elements(self) -> int:
        """KV-cache values per token per layer in llama.cpp: the latent and the shared rope key."""
        return self.d_c + self.d_rope


def deepseek_shape(config: dict, engine: GGUFEngine = MAINLINE) -> DeepseekShape:
    """Check a DeepSeek-V3 config against what `engine`'s deepseek2 GGUF can hold; one-line ExportError otherwise."""
    if config.get("model_type") not in ("deepseek_v3", "deepseek_v2"):
        raise ExportError(f"GGUF export expects a DeepSeek-V3 config, got model_type {config.get('model_type')!r}")
    layers = int(config["num_hidden_layers"])
    if int(config.get("first_k_dense_replace") or 0) < layers:
        raise ExportError("GGUF export: mixture-of-experts layers are not supported (dense models only)")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ExportError(f"GGUF export: {engine.name}'s deepseek2 has no attention or MLP biases (export with --drop-biases)")
    if config.get("hidden_act", "silu") != "silu":
        raise ExportError(f"GGUF export: {engine.name}'s deepseek2 uses SiLU, not {config['hidden_act']!r}")
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ExportError(f"GGUF export: {rope_type!r} RoPE scaling cannot be written for {engine.name}'s deepseek2")
    if int(config["qk_nope_head_dim"]) < 1:
        raise ExportError(f"GGUF export: {engine.name}'s deepseek2 needs at least one non-rope key dim per head (qk_nope_head_dim 0)")
    heads = int(config["num_attention_heads"])
    if int(config.get("num_key_value_heads", heads)) != heads:
        raise ExportError("GGUF export expects num_key_value_heads == num_attention_heads (DeepSeek's MLA)")
    shape = DeepseekShape(
        num_layers=layers,
        hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config["intermediate_size"]),
        num_heads=heads,
        vocab_size=int(config["vocab_size"]),
        d_nope=int(config["qk_nope_head_dim"]),
        d_rope=int(config["qk_rope_head_dim"]),
        d_v=int(config["v_head_dim"]),
        d_c=int(config["kv_lora_rank"]),
        q_lora_rank=int(config.get("q_lora_rank") or 0),
        rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        rope_interleave=bool(config.get("rope_interleave", True)),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        max_positions=int(config.get("max_position_embeddings", 4096)),
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
    )
    return _for_engine(shape, engine)


def _for_engine(shape: DeepseekShape, engine: GGUFEngine) -> DeepseekShape:
    """The shape as `engine` reads it (tied embeddings untied, a full-rank q_a path), or its refusal."""
    if engine.untie:
        shape = replace(shape, tied_embeddings=False)
    if not engine.lite_layers:  # mainline reads q_lora_rank at every layer count
        return shape
    lite = shape.num_layers in engine.lite_layers
    if lite and shape.q_lora_rank:
        raise ExportError(f"{engine.name} loads every {shape.num_layers}-layer deepseek2 as DeepSeek-V2-Lite, "
                          "with a plain query projection: a query low rank (q_lora_rank) cannot be written")
    if shape.num_layers == 48 and shape.vocab_size == 128256 and (shape.q_lora_rank or engine.full_rank_q):
        raise ExportError(f"{engine.name} reads no q_lora_rank for a 48-layer deepseek2 with a 128256-token "
                          "vocabulary but loads its query as q_a/q_b: no query layout loads"
                          + (" (a plain query does with --plain-query and ik's plain-query patch)" if engine.full_rank_q else ""))
    return replace(shape, full_rank_q=engine.full_rank_q and not lite and not shape.q_lora_rank)


def add_hparams(writer: gguf.GGUFWriter, shape: DeepseekShape, weight_type: str, name: str,
                engine: GGUFEngine = MAINLINE) -> None:
    """The deepseek2 keys `engine` reads (see the module notes for which are required)."""
    writer.add_name(name)
    writer.add_block_count(shape.num_layers)
    writer.add_context_length(shape.max_positions)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_head_count(shape.num_heads)
    writer.add_head_count_kv(shape.num_heads if engine.heads_kv else 1)  # mainline: absorbed MLA is MQA over the latent
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_rope_dimension_count(shape.d_rope)
    writer.add_layer_norm_rms_eps(shape.rms_norm_eps)
    writer.add_vocab_size(shape.vocab_size)
    writer.add_leading_dense_block_count(shape.num_layers)
    writer.add_q_lora_rank(shape.q_rank_written)
    writer.add_kv_lora_rank(shape.d_c)
    if engine.heads_kv:  # ik_llama.cpp: it also requires expert_weights_scale, even for a dense model
        writer.add_key_length(shape.d_nope + shape.d_rope)
        writer.add_value_length(shape.d_v)
        writer.add_expert_weights_scale(1.0)
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)  # unused (no experts); read, else guessed aloud
    else:
        writer.add_key_length(shape.d_c + shape.d_rope)
        writer.add_value_length(shape.d_c)
        writer.add_key_length_mla(shape.d_nope + shape.d_rope)
        writer.add_value_length_mla(shape.d_v)
    writer.add_expert_feed_forward_length(shape.intermediate_size)
    writer.add_expert_shared_count(0)
    writer.add_file_type(FILE_TYPES[weight_type])
    if weight_type == "q8_0":
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def interleave_rope_rows(weight: torch.Tensor, block: int, d_rope: int) -> torch.Tensor:
    """Rotate-half rope rows (i, i + d_r/2) -> adjacent pairs (2i, 2i+1), in the last d_rope rows
    of every `block` rows."""
    half = d_rope // 2
    order = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).flatten()  # [d_r]
    blocks = weight.reshape(-1, block, weight.shape[-1])  # [n, block, in]
    rope = blocks[:, block - d_rope:][:, order]  # [n, d_r, in]
    return torch.cat([blocks[:, : block - d_rope], rope], dim=1).reshape(weight.shape)


def full_rank_q(w_q: torch.Tensor, input_norm: torch.Tensor, eps: float) -> list[tuple[str, torch.Tensor]]:
    """A plain query W_q [H*qk, D] as q_a = s I, q_a_norm = sqrt(eps)/s, q_b = W_q (module notes)."""
    D = w_q.shape[1]
    eye = torch.eye(D, dtype=torch.float64)  # [D, D]
    s = norm_trick_scale(eye, None, input_norm, D, eps)
    return [("attn_q_a.weight", eye * s), ("attn_q_a_norm.weight", torch.full((D,), math.sqrt(eps) / s)),
            ("attn_q_b.weight", w_q)]


def gguf_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]], shape: DeepseekShape, engine: GGUFEngine = MAINLINE
) -> Iterable[tuple[str, torch.Tensor]]:
    """DeepseekV3 (name, tensor) -> deepseek2 GGUF (name, tensor), torch layout; refuses the rest.

    A full-rank q_a path needs its layer's input norm (the bound of the norm trick): a q_proj that
    comes before it waits for it."""
    qk = shape.d_nope + shape.d_rope
    input_norms: dict[str, torch.Tensor] = {}
    waiting: dict[str, torch.Tensor] = {}  # block -> its q_proj, until the input norm arrives
    written: set[str] = set()
    embedding = None
    for name, tensor in tensors:
        if name.endswith(".bias"):
            raise ExportError(f"GGUF export: {engine.name}'s deepseek2 has no biases ({name})")
        if name in GLOBAL_TENSORS:
            if name == "lm_head.weight" and shape.tied_embeddings:
                continue
            written.add(GLOBAL_TENSORS[name])
            embedding = tensor if name == "model.embed_tokens.weight" else embedding
            yield GLOBAL_TENSORS[name], tensor
            continue
        parts = name.split(".", 3)
        if len(parts) < 4 or parts[:2] != ["model", "layers"] or parts[3] not in LAYER_TENSORS:
            raise ExportError(f"GGUF export: no deepseek2 tensor for {name}")
        block, rel = f"blk.{parts[2]}.", parts[3]
        if rel == "self_attn.kv_b_proj.weight":
            kv_b = tensor.reshape(shape.num_heads, shape.d_nope + shape.d_v, shape.d_c)  # [H, d_nope+d_v, d_c]
            k_b, v_b = kv_b.split([shape.d_nope, shape.d_v], dim=1)
            k_b, v_b = k_b.transpose(1, 2).contiguous(), v_b.contiguous()  # [H, d_c, d_nope], [H, d_v, d_c]
            if engine.whole_kv_b:  # ik: kv_b for its prompt path, k_b/v_b as [H*d_c, d_nope], [H*d_v, d_c]
                yield block + "attn_kv_b.weight", tensor  # [H*(d_nope+d_v), d_c]
                k_b, v_b = k_b.flatten(0, 1), v_b.flatten(0, 1)
            yield block + "attn_k_b.weight", k_b
            yield block + "attn_v_b.weight", v_b
            continue
        if not shape.rope_interleave:
            if rel in ("self_attn.q_proj.weight", "self_attn.q_b_proj.weight"):
                tensor = interleave_rope_rows(tensor, qk, shape.d_rope)  # [H*qk, in]
            elif rel == "self_attn.kv_a_proj_with_mqa.weight":
                tensor = interleave_rope_rows(tensor, shape.d_c + shape.d_rope, shape.d_rope)  # [d_c+d_r, D]
        if shape.full_rank_q and rel in ("self_attn.q_proj.weight", "input_layernorm.weight"):
            if rel == "input_layernorm.weight":
                input_norms[block] = tensor
                yield block + LAYER_TENSORS[rel], tensor
            else:
                waiting[block] = tensor
            if block in waiting and block in input_norms:
                for q_name, q_tensor in full_rank_q(waiting.pop(block), input_norms[block], shape.rms_norm_eps):
                    yield block + q_name, q_tensor
            continue
        yield block + LAYER_TENSORS[rel], tensor
    if waiting:
        raise ExportError(f"GGUF export: no input norm for the query of {next(iter(waiting))}")
    if not shape.tied_embeddings and "output.weight" not in written and embedding is not None:
        yield "output.weight", embedding  # a tied checkpoint without lm_head, untied for the engine


def expected_tensor_count(shape: DeepseekShape, engine: GGUFEngine = MAINLINE) -> int:
    # norms 2, q 1|3, kv_a 1, kv_norm 1, k_b + v_b (+ kv_b), o, ffn 3
    per_layer = 8 + (3 if shape.q_rank_written else 1) + (3 if engine.whole_kv_b else 2)
    return 2 + (0 if shape.tied_embeddings else 1) + shape.num_layers * per_layer


def tensor_type(gguf_name: str, array: np.ndarray, weight_type: str) -> gguf.GGMLQuantizationType:
    if array.ndim == 1:
        return Q.F32
    if gguf_name.endswith(SCALED):
        return Q.F32 if weight_type == "f32" else Q.BF16
    qtype = MATRIX_TYPES[weight_type]
    if qtype == Q.Q8_0 and array.shape[-1] % gguf.GGML_QUANT_SIZES[Q.Q8_0][0] != 0:
        return Q.BF16
    return qtype


@dataclass
class GGUFExportResult:
    path: Path
    weight_type: str
    tokenizer_pre: str
    tensors: int
    bytes: int
    cache_elements: int  # per token per layer, d_c + d_r
    engine: str = MAINLINE.name


def write_gguf(
    config: dict,
    tensors: Iterable[tuple[str, torch.Tensor]],
    tokenizer_dir: str | Path,
    output: str | Path,
    weight_type: str = "f32",
    tokenizer_pre: str | None = None,
    name: str | None = None,
    engine: GGUFEngine = MAINLINE,
) -> GGUFExportResult:
    """Stream (name, tensor) pairs of a DeepSeek-V3 model into `output` as a deepseek2 GGUF for `engine`.

    Tensors are converted one at a time into a spooled temporary file; the GGUF appears at
    `output` only when everything was written (a refusal leaves nothing behind)."""
    if weight_type not in GGUF_TYPES:
        raise ExportError(f"GGUF type must be one of {', '.join(GGUF_TYPES)}, got {weight_type!r}")
    shape = deepseek_shape(config, engine)
    output = Path(output)
    writer = gguf.GGUFWriter(None, ARCH, use_temp_file=True)
    add_hparams(writer, shape, weight_type, name or output.stem, engine)
    pre = add_vocab(writer, tokenizer_dir, shape.vocab_size, tokenizer_pre)
    count = 0
    for gguf_name, tensor in gguf_tensors(tensors, shape, engine):
        array = tensor.detach().to(torch.float32).cpu().numpy()
        qtype = tensor_type(gguf_name, array, weight_type)
        writer.add_tensor(gguf_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        count += 1
    if count != expected_tensor_count(shape, engine):
        raise ExportError(f"GGUF export: got {count} tensors, a {shape.num_layers}-layer model has "
                          f"{expected_tensor_count(shape, engine)}")
    partial = output.with_name(output.name + ".partial")
    try:
        writer.write_header_to_file(path=partial)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(partial, output)
    finally:
        partial.unlink(missing_ok=True)
    return GGUFExportResult(output, weight_type, pre, count, output.stat().st_size, shape.cache_elements, engine.name)


def export_gguf(
    model_dir: str | Path,
    output: str | Path,
    weight_type: str = "f32",
    tokenizer_pre: str | None = None,
    drop_biases: bool = False,
    pad_value: bool = False,
    force: bool = False,
    progress: bool = True,
    engine: GGUFEngine = MAINLINE,
) -> GGUFExportResult:
    """A native converted model -> DeepSeek-V3 tensors (export/deepseek.py, one layer at a time) ->
    a deepseek2 GGUF for `engine` at `output`. The tokenizer is the model folder's."""
    from transformers import DeepseekV3Config

    from ..checkpoint.reader import SafetensorsReader
    from .deepseek import deepseek_tensors, prepare_export
    from .options import ExportOptions

    model_dir, output = Path(model_dir), Path(output)
    if output.exists() and not force:
        raise ExportError(f"{output} exists (pass --force to replace it)")
    native, plan = prepare_export(model_dir, ExportOptions(drop_biases=drop_biases, pad_value=pad_value), engines=())
    config = DeepseekV3Config(**plan.config).to_dict()
    # The DeepSeek folder writes a tied lm_head out (not every engine ties); llama.cpp ties by
    # leaving `output` out, as the source's own GGUF does.
    config["tie_word_embeddings"] = bool(getattr(native, "tie_word_embeddings", False))
    with SafetensorsReader(model_dir) as reader:
        tensors = deepseek_tensors(reader, plan, progress)
        return write_gguf(config, tensors, model_dir, output, weight_type, tokenizer_pre, name=model_dir.name,
                          engine=engine)
