"""`--format gguf-ik` checked in a real ik_llama.cpp (built by `make ik-llama-cpp`): tiny conversions
written with ik's deepseek2 conventions (export/gguf.py, IK) give our native model's logits there, in
prefill (short, and 144 tokens: ik decompresses the cache for 128+) and token-by-token decode, in its
MLA modes -mla 3 -fa 1 (flash MLA) and -mla 1 -fa 0 (the GEMM path), with a cache of d_c + d_r values
per token per layer. The shapes: rope 64 with latent 128, 256 and 512 (the widths ik's CPU flash
attention has kernels for: 192/128, 320/256, 576/512) and rope 32 with latent 64 (96/64: no kernel).

ik has no f32 attention on the CPU: its flash attention aborts on an f32 cache (iqk_flash_attn.cpp,
are_kv_types_supported: f16, q8_0, q8_KV, q6_0, bf16) and without flash attention it refuses a V cache
that is not f16 or bf16 (llama.cpp: "V cache quantization requires flash_attn"). So flash MLA runs
with an f16 cache, and the GEMM path with the latent cache in f32 and its transposed copy in f16 (the
attention weights are rounded to f16 to multiply it). f16 keeps 11 bits (relative rounding <= 2^-11 =
4.9e-4 per value): the logits differ from ours by 2.2e-4 relative (measured, every shape), within
TOL; in the kernel shapes the two modes agree with each other to 1e-5 (2e-6 measured), the same
arithmetic (ggml's generic loop, taken by 96/64, accumulates in f16: 4.6e-4 from the GEMM path).
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
import transformers
from test_export_gguf import TOKENS, converted, relative_error, tiny_deepseek

from transmla.bench.llama_cpp import IK, applied_patches, ik_batched_bench, ik_kv_cache_report, ik_memory, llama_logits, op_timing
from transmla.export.engines import IK_FLASH_WIDTHS
from transmla.export.errors import ExportError
from transmla.export.gguf import IK as IK_GGUF
from transmla.export.gguf import IK_PLAIN_QUERY
from transmla.export.gguf import export_gguf, write_gguf

# name -> (-mla, -fa, K,V cache types); flash-absorbed decodes as flash-mla but keeps prompts absorbed
MODES = {"flash-mla": (3, True, "f16"), "gemm": (1, False, "f32,f16"), "flash-absorbed": (1, True, "f16")}
TOL = 1e-3  # relative: twice the f16 rounding ik cannot avoid (module notes)
TOL_FLASH_PROMPT = 3e-3  # flash prompts of 128+ tokens: -mla 3's decompressed K and V in f16, or ggml's f16 loop
LONG = [(7 * i * i + 3 * i + 1) % 300 for i in range(144)]  # >= 128 tokens: ik's prompt path (pp_opt)
HEAD64 = dict(hidden_size=128, num_attention_heads=8, head_dim=64)
# name -> (family, source overrides, conversion options); no output fit (the shapes are what matter)
CASES = {
    "r64-c128": ("llama", {**HEAD64, "num_key_value_heads": 4}, dict(kv_lora_rank=128, rope_dim=64)),
    "r64-c256": ("llama", {**HEAD64, "num_key_value_heads": 4}, dict(kv_lora_rank=256, rope_dim=64)),
    "r64-c512": ("llama", {**HEAD64, "num_key_value_heads": 8}, dict(kv_lora_rank=512, rope_dim=64)),
    "r32-c64": ("llama", {**HEAD64, "num_key_value_heads": 4}, dict(kv_lora_rank=64, rope_dim=32)),
    "r64-c128-qlora-tied": ("mistral", {**HEAD64, "num_key_value_heads": 4, "tie_word_embeddings": True},
                            dict(kv_lora_rank=128, rope_dim=64, q_lora_rank=96)),
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """case -> (GGUF export result, our native model's logits on TOKENS and on LONG), converted once."""
    done = {}

    def get(case):
        if case not in done:
            tmp = tmp_path_factory.mktemp(case)
            family, overrides, options = CASES[case]
            native = converted(tmp, family, overrides, dict(method="transmla", shared_rope=True, fit_steps=0, **options))
            result = export_gguf(native, tmp / "ik.gguf", progress=False, engine=IK_GGUF)
            model = transformers.AutoModelForCausalLM.from_pretrained(native, dtype=torch.float32).eval()
            with torch.no_grad():
                refs = [model(torch.tensor([ids])).logits[0] for ids in (TOKENS, LONG)]  # [T, V]
            done[case] = (result, model.config.mla, refs)
        return done[case]

    return get


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", list(CASES))
def test_ik_llama_cpp_runs_our_conversions_exactly(exported, case, mode):
    result, mla, (ref, ref_long) = exported(case)
    assert (mla["kv_lora_rank"], mla["qk_rope_head_dim"]) == (CASES[case][2]["kv_lora_rank"], CASES[case][2]["rope_dim"])
    mla_mode, flash, cache = MODES[mode]
    runs = {}
    for run in ("prefill", "decode"):
        runs[run], log = llama_logits(result.path, TOKENS, run, n_ctx=512, build=IK, mla=mla_mode, flash_attn=flash,
                                      cache_type=cache)
        assert f"mla_attn      = {mla_mode}" in log
        assert relative_error(runs[run], ref) <= TOL, run
    logits, log = llama_logits(result.path, LONG, "prefill", n_ctx=512, build=IK, mla=mla_mode, flash_attn=flash,
                               cache_type=cache)
    # -mla 3 decompresses K and V to f16; -mla 1 -fa 1 without a kernel (96/64) runs ggml's loop, f16 sums
    generic = flash and (result.cache_elements, mla["kv_lora_rank"]) not in IK_FLASH_WIDTHS
    assert relative_error(logits, ref_long) <= (TOL_FLASH_PROMPT if mla_mode == 3 or generic else TOL), "prefill of 144 tokens"
    if flash and (result.cache_elements, mla["kv_lora_rank"]) in IK_FLASH_WIDTHS:
        # ik's kernel and the GEMM path with the same f16 cache do the same arithmetic (2e-6 apart, measured);
        # ggml's generic loop (96/64) accumulates in f16 and lands 4.6e-4 away, still within TOL of ours
        gemm, _ = llama_logits(result.path, TOKENS, "decode", n_ctx=512, build=IK, mla=1, flash_attn=False, cache_type="f16")
        assert relative_error(runs["decode"], torch.from_numpy(gemm)) <= 1e-5
    kv = ik_kv_cache_report(log)
    layers = len(mla["rope_inv_freq"])
    mib = kv.cells * layers / 2**20  # per value per token per layer
    assert result.cache_elements == mla["kv_lora_rank"] + mla["qk_rope_head_dim"]
    assert kv.c_mib == pytest.approx(mib * result.cache_elements * (2 if flash else 4), abs=0.0051)
    # -mla 1 without flash attention also keeps the latent transposed (kv^T, d_c more per token)
    assert kv.kv_t_mib == pytest.approx(0 if flash else mib * mla["kv_lora_rank"] * 2, abs=0.0051)


@pytest.mark.parametrize("mode", ["flash-mla", "gemm"])
def test_ik_value_padding_keeps_the_logits(tmp_path, mode):
    """--pad-value: each head's value zero-padded to the key's width (64 -> 128 here, so -mla 3's prompt
    attention runs at 128/128, a pair ik has a kernel for): the same logits in prefill of 128+ tokens
    (the decompressing prompt path) and in decode, the same cache, the header's value width the key's."""
    family, overrides, options = CASES["r64-c128"]
    native = converted(tmp_path, family, overrides, dict(method="transmla", shared_rope=True, fit_steps=0, **options))
    result = export_gguf(native, tmp_path / "ik.gguf", progress=False, engine=IK_GGUF, pad_value=True)
    fields = gguf.GGUFReader(result.path).fields
    value = lambda key: int(fields[key].parts[-1][0])  # noqa: E731
    assert value("deepseek2.attention.key_length") == value("deepseek2.attention.value_length") == 128
    assert result.cache_elements == 128 + 64
    model = transformers.AutoModelForCausalLM.from_pretrained(native, dtype=torch.float32).eval()
    mla_mode, flash, cache = MODES[mode]
    with torch.no_grad():
        for ids, run in ((LONG, "prefill"), (TOKENS, "decode")):
            ref = model(torch.tensor([ids])).logits[0]
            logits, _ = llama_logits(result.path, ids, run, n_ctx=512, build=IK, mla=mla_mode, flash_attn=flash,
                                     cache_type=cache)
            assert relative_error(logits, ref) <= (TOL_FLASH_PROMPT if run == "prefill" and flash else TOL), run


@pytest.mark.parametrize(
    "overrides",
    [{}, {"rope_interleave": False}, {"q_lora_rank": 24}, {"num_hidden_layers": 26, "first_k_dense_replace": 26}],
    ids=["interleaved-rope", "rotate-half-rope", "q-lora", "lite-26-layers"],
)
def test_ik_llama_cpp_logits_equal_transformers(tmp_path, overrides):
    """A stock tiny DeepseekV3 written for ik: a plain query through the full-rank q_a path (or attn_q
    for the 26/27 layers ik loads as DeepSeek-V2-Lite)."""
    model = tiny_deepseek(tmp_path / "ds", **overrides)
    config = json.loads((tmp_path / "ds" / "config.json").read_text())
    from safetensors.torch import load_file

    tensors = load_file(tmp_path / "ds" / "model.safetensors")
    result = write_gguf(config, iter(tensors.items()), tmp_path / "ds", tmp_path / "ds.gguf", engine=IK_GGUF)
    names = {t.name for t in gguf.GGUFReader(result.path).tensors}
    assert ("blk.0.attn_q.weight" in names) == ("num_hidden_layers" in overrides)
    assert {"blk.0.attn_kv_b.weight", "blk.0.attn_k_b.weight", "blk.0.attn_v_b.weight"} <= names
    with torch.no_grad():
        ref = model(torch.tensor([TOKENS])).logits[0]
    for mode, (mla_mode, flash, cache) in MODES.items():
        logits, _ = llama_logits(result.path, TOKENS, "decode", build=IK, mla=mla_mode, flash_attn=flash, cache_type=cache)
        assert relative_error(logits, ref) <= TOL, mode


PLAIN_QUERY = "plain-query"  # tools/ik_llama_cpp/plain-query.patch


@pytest.mark.parametrize("mode", list(MODES))
def test_ik_plain_query_loads_only_where_the_patch_is(tmp_path, mode):
    """--plain-query: one attn_q matrix (q_lora_rank 0, no q_a path) at a layer count stock ik loads only
    with q_a/q_b. ik built with plain-query.patch (`make ik-llama-cpp-patched`) gives our logits in every
    MLA mode; the engine as its users get it refuses the file (a missing attn_q_a), which is why the
    default writes the full-rank q_a path."""
    family, overrides, options = CASES["r64-c128"]
    native = converted(tmp_path, family, overrides, dict(method="transmla", shared_rope=True, fit_steps=0, **options))
    result = export_gguf(native, tmp_path / "ik.gguf", progress=False, engine=IK_PLAIN_QUERY)
    reader = gguf.GGUFReader(result.path)
    names = {t.name for t in reader.tensors}
    assert "blk.0.attn_q.weight" in names and "blk.0.attn_q_a.weight" not in names
    assert int(reader.fields["deepseek2.attention.q_lora_rank"].parts[-1][0]) == 0
    assert int(reader.fields["deepseek2.block_count"].parts[-1][0]) not in (26, 27)
    mla_mode, flash, cache = MODES[mode]
    if PLAIN_QUERY not in applied_patches(IK):
        with pytest.raises(RuntimeError, match="attn_q_a"):
            llama_logits(result.path, TOKENS, "decode", build=IK, mla=mla_mode, flash_attn=flash, cache_type=cache)
        return
    model = transformers.AutoModelForCausalLM.from_pretrained(native, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([TOKENS])).logits[0]
    for run in ("prefill", "decode"):
        logits, _ = llama_logits(result.path, TOKENS, run, build=IK, mla=mla_mode, flash_attn=flash, cache_type=cache)
        assert relative_error(logits, ref) <= TOL, run


def test_cli_plain_query_is_a_gguf_ik_option(cli, tmp_path):
    native = converted(tmp_path, "llama", {}, dict(method="transmla", kv_budget=0.25, shared_rope=True, fit_steps=0))
    for fmt, out_path in (("gguf", tmp_path / "m.gguf"), ("deepseek", tmp_path / "ds")):
        code, out, err = cli("export", native, out_path, "--format", fmt, "--plain-query")
        assert code != 0 and "--plain-query applies to --format gguf-ik only" in err
        assert len(err.strip().splitlines()) == 1 and not out_path.exists()
    code, out, err = cli("export", native, tmp_path / "ik.gguf", "--format", "gguf-ik", "--plain-query", "--json")
    assert code == 0, err
    assert json.loads(out)["engine"] == IK_PLAIN_QUERY.name
    assert "blk.0.attn_q.weight" in {t.name for t in gguf.GGUFReader(tmp_path / "ik.gguf").tensors}


def test_ik_header_follows_its_loader(tmp_path):
    tiny_deepseek(tmp_path / "ds")
    from safetensors.torch import load_file

    config = json.loads((tmp_path / "ds" / "config.json").read_text())
    tensors = load_file(tmp_path / "ds" / "model.safetensors")
    result = write_gguf(config, iter(tensors.items()), tmp_path / "ds", tmp_path / "ds.gguf", "q8_0", engine=IK_GGUF)
    reader = gguf.GGUFReader(result.path)
    value = lambda key: reader.fields[f"deepseek2.{key}"].parts[-1][0]  # noqa: E731
    assert value("attention.head_count_kv") == value("attention.head_count") == 4
    assert (value("attention.key_length"), value("attention.value_length"), value("rope.dimension_count")) == (24, 16, 8)
    assert value("attention.q_lora_rank") == 64  # the hidden size: q_a = s I
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.attn_q_a.weight"] == gguf.GGMLQuantizationType.BF16  # tiny-scaled: never Q8_0
    assert types["blk.0.attn_q_b.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert types["blk.0.attn_kv_b.weight"] == gguf.GGMLQuantizationType.Q8_0  # rows of d_c = 32
    assert types["blk.0.attn_k_b.weight"] == gguf.GGMLQuantizationType.BF16  # rows of d_nope = 16
    shapes = {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}  # GGUF order: ne0 first
    assert shapes["blk.0.attn_k_b.weight"] == (16, 4 * 32) and shapes["blk.0.attn_v_b.weight"] == (32, 4 * 16)
    assert result.cache_elements == 32 + 8


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [({"num_hidden_layers": 26, "q_lora_rank": 24}, "DeepSeek-V2-Lite"),
     ({"num_hidden_layers": 48, "vocab_size": 128256}, "no query layout"),
     ({"attention_bias": True}, "biases"), ({"qk_nope_head_dim": 0, "qk_rope_head_dim": 24}, "qk_nope_head_dim 0")],
    ids=["lite-with-q-lora", "48-layers-128256-vocab", "bias", "all-rope"],
)
def test_shapes_ik_cannot_load_are_refused(tmp_path, overrides, reason):
    config = transformers.DeepseekV3Config(**{**dict(vocab_size=300, hidden_size=64, num_hidden_layers=2,
                                                     num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                                                     qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                                     q_lora_rank=None, first_k_dense_replace=2),
                                                  **overrides, "first_k_dense_replace": overrides.get("num_hidden_layers", 2)})
    with pytest.raises(ExportError, match=reason):
        write_gguf(config.to_dict(), iter(()), tmp_path, tmp_path / "x.gguf", engine=IK_GGUF)
    assert list(tmp_path.glob("x.gguf*")) == []


def test_cli_export_gguf_ik(cli, tmp_path):
    native = converted(tmp_path, "llama", {}, dict(method="transmla", kv_budget=0.25, shared_rope=True, fit_steps=0))
    out_path = tmp_path / "m.gguf"
    code, out, err = cli("export", native, out_path, "--format", "gguf-ik", "--type", "q8_0", "--json")
    assert code == 0, err
    info = json.loads(out)
    assert info["format"] == "gguf-ik (ik_llama.cpp deepseek2)" and info["type"] == "q8_0"
    logits, _ = llama_logits(out_path, TOKENS, "decode", build=IK, mla=3, flash_attn=True)
    assert np.isfinite(logits).all()


@pytest.mark.parametrize(
    ("shape", "ik_decode", "vllm"),
    [((128, 64, 64, 64), True, False), ((256, 64, 128, 128), True, True), ((512, 64, 128, 128), True, True),
     ((64, 32, 32, 64), False, False), ((160, 32, 64, 64), False, False)],
)
def test_fast_kernel_report_names_the_engine_shapes(shape, ik_decode, vllm):
    from transmla.export.engines import fast_kernel_report

    report = fast_kernel_report(*shape)
    assert report["ik_llama.cpp flash MLA"][0] is ik_decode
    assert f"{shape[0] + shape[1]}/{shape[0]}" in report["ik_llama.cpp flash MLA"][1]
    assert report["vLLM MLA"][0] is vllm
    assert report["llama.cpp"][0] is False and "per head" in report["llama.cpp"][1]
    # prompts: fast under -mla 1 -fa 1 (absorbed: the decode widths) wherever decode is, or under -mla 3
    # where the decompressed (d_nope + d_r, d_v) has a kernel
    prompt_pair = (shape[2] + shape[1], shape[3])
    assert report["ik_llama.cpp prompts"][0] is (ik_decode or prompt_pair in ((192, 128), (128, 128), (64, 64)))
    assert f"{prompt_pair[0]}/{prompt_pair[1]}" in report["ik_llama.cpp prompts"][1]


@pytest.mark.parametrize("shared_rope", [True, False])
def test_inspect_tells_which_engine_runs_a_conversion_fast(cli, tmp_path, shared_rope):
    native = converted(tmp_path, "llama", HEAD64 | {"num_key_value_heads": 4},
                       dict(method="transmla", kv_lora_rank=128, rope_dim=64, shared_rope=shared_rope, fit_steps=0))
    code, out, err = cli("inspect", native, "--json")
    assert code == 0, err
    info = json.loads(out)
    if shared_rope:
        assert info["fast kernel in ik_llama.cpp flash MLA"].startswith("yes: -mla 1|3 -fa 1 decode runs (K, V) = 192/128")
        assert info["fast kernel in vLLM MLA"].startswith("no: latent + rope = 192")
    else:  # per-layer rope frequencies: no engine runs it at all
        assert all(info[f"fast kernel in {e}"].startswith("no: not exportable") for e in
                   ("ik_llama.cpp flash MLA", "vLLM MLA", "llama.cpp"))


PARALLEL_FAULT = ("ik_llama.cpp 0.1.5's CPU flash attention bounds the K blocks of each q step by the mask of its "
                  "last row only (iqk_fa_templates.h compute_helper); with two sequences in a batch that row is the "
                  "other sequence's: blocks are skipped (prompt 128: the generated tokens, 2.6e-2 off) or none "
                  "is read (prompt 64: GGML_ASSERT(S > 0))")


PARALLEL_FIX = "parallel-flash-attention"  # tools/ik_llama_cpp/parallel-flash-attention.patch


@pytest.mark.parametrize("prompt", [64, 128])
@pytest.mark.parametrize("mode", [pytest.param("flash-mla", marks=pytest.mark.xfail(
    PARALLEL_FIX not in applied_patches(IK), strict=True, reason=PARALLEL_FAULT)), "gemm"])
def test_ik_parallel_decode_equals_one_sequence(exported, mode, prompt):
    """Two sequences with their own prompts decoded together give each one's own logits (a server with
    parallel slots): the GEMM path does (2e-7 measured); flash MLA does not (a fault of ik, xfail). With
    compute_helper's bound taken over every row of the q step (the patch, in `make ik-llama-cpp-patched`
    with four more; IK_LLAMA_CPP_DIR=~/.cache/transmla/ik_llama.cpp-0.1.5-patched runs this test on it, where it
    passes), flash MLA gives 2.1e-7 (prompt 64) and 2.5e-4 (prompt 128: f16 rounding of another kernel path),
    so the bound here is TOL, far below the fault's 2.6e-2."""
    result, _, _ = exported("r64-c128")
    tokens = (LONG * 2)[: prompt + 8]
    mla_mode, flash, cache = MODES[mode]
    one, _ = llama_logits(result.path, tokens, "decode", n_ctx=1024, build=IK, mla=mla_mode, flash_attn=flash, cache_type=cache)
    both, _ = llama_logits(result.path, tokens, "parallel", n_ctx=1024, build=IK, mla=mla_mode, flash_attn=flash, cache_type=cache)
    for seq in (0, 1):  # the 8 tokens decoded together (the prompts ran as prefill, not token by token)
        assert relative_error(both[seq][prompt:], torch.from_numpy(one[prompt:])) <= TOL, seq


@pytest.mark.parametrize("mode", ["flash-mla", "gemm"])
def test_ik_memory_reports_what_the_context_allocates(exported, mode):
    """ik_memory (the memory phase of benchmarks/ik_llama_cpp): ik's own buffer sizes for a context of n
    cells, the cache d_c + d_r f16 values per cell per layer (and, without flash attention, d_c more for
    kv^T), growing with n while the weights stay; the peak RSS of the process that allocated them."""
    result, mla, _ = exported("r64-c128")
    mla_mode, flash, _ = MODES[mode]
    layers = len(mla["rope_inv_freq"])
    per_cell = (result.cache_elements + (0 if flash else mla["kv_lora_rank"])) * layers * 2 / 2**20  # MiB
    small, large = (ik_memory(result.path, n, mla_mode, flash, "f16") for n in (4096, 8192))
    for probe, cells in ((small, 4096), (large, 8192)):
        assert probe["n_ctx"] == cells  # the cells ik made (it rounds small requests up: 1024 -> 2048 here)
        assert probe["kv"] == pytest.approx(cells * per_cell, abs=0.0051)
        assert probe["total"] == pytest.approx(sum(probe[k] for k in ("weights", "kv", "output", "compute")))
        assert probe["rss"] > probe["kv"]
    assert large["weights"] == small["weights"] > 0
    assert large["rss"] > small["rss"]


def test_ik_memory_fails_plainly_on_a_file_ik_cannot_load(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file")
    with pytest.raises(RuntimeError, match="printed no weights buffer size"):
        ik_memory(bad, 1024)


def test_ik_batched_bench_records_each_sequence_count(exported):
    """benchmarks.ik_llama_cpp --phase parallel: one real llama-batched-bench run per sequence count, each record
    with that count, its prompt and decode lengths, the cells they filled and how the build lays the prompts out;
    decode_ops only from a build with op-timing.patch."""
    result, _, _ = exported("r64-c128")
    rows = ik_batched_bench(result.path, 64, 4, [1, 2], threads=1, mla=1, flash_attn=False, cache_type="f16")
    patches = applied_patches(IK)
    assert [r["sequences"] for r in rows] == [1, 2]
    for r in rows:
        assert (r["depth"], r["n_gen"], r["n_kv"]) == (64, 4, r["sequences"] * 68)
        assert r["decode_tps"] > 0 and r["prompt_tps"] > 0
        assert r["prompt_layout"] == ("contiguous" if "contiguous-prompts" in patches else "interleaved")
        assert ("decode_ops" in r) == ("op-timing" in patches)


def test_op_timing_reads_the_patch_report():
    log = ("noise\ntransmla-op-timing: 33 decode graphs, 1000.0 us each\n"
           "transmla-op-timing: FLASH_ATTN_EXT:kqv_compressed          600.0 us/graph      990 nodes\n"
           "transmla-op-timing: MUL_MAT:q                               390.0 us/graph     1980 nodes\n"
           "transmla-op-timing: ROPE:q_rope                               6.0 us/graph      990 nodes\n"
           "transmla-op-timing: CPY:cache_k_l9 (view) (copy of kvr-9)     4.0 us/graph       33 nodes\n")
    assert op_timing(log) == {"graphs": 33, "step_us": 1000.0,
                              "ops": {"FLASH_ATTN_EXT:kqv_compressed": 600.0, "MUL_MAT:q": 390.0, "other": 10.0}}
    assert op_timing("no report") == {}
