"""DeepSeek-V3 export: stock transformers, in a process that never imports transmla, gives the
native converted model's logits (prefill and token-by-token decode), and what cannot be exported
exactly is refused with one line and nothing on disk."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_model, save_word_tokenizer
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

import transmla  # noqa: F401  (registers the native MLA models)
from transmla.convert.api import convert
from transmla.convert.options import ConvertOptions
from transmla.convert.pipeline import LayerStream, write_mla_checkpoint
from transmla.convert.registry import get_method
from transmla.export.deepseek import ExportError, export_deepseek
from transmla.export.deepseek_layer import norm_trick_scale
from transmla.export.options import ExportOptions

STOCK = Path(__file__).parent / "engines" / "stock_transformers.py"
IDS = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(5))
CALIB = torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(1))


def _convert(src: Path, out: Path, **options) -> Path:
    """The production conversion (calibrated on fixed ids), written to disk."""
    config = AutoConfig.from_pretrained(src)
    opts = ConvertOptions.of(device="cpu", **options)
    layers = LayerStream(get_method(opts.method), src, config, opts, progress=False, calib_ids=CALIB)
    write_mla_checkpoint(src, config, out, layers, layers.record, progress=False)
    return out


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
# transformers 5 spells rope scaling `rope_parameters` (rope_scaling is the old name). With no mscale
# fields, transformers' yarn and vLLM/SGLang's DeepSeek-YaRN scale cos/sin by the same 0.1 ln(4) + 1.
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
# mscale_all_dim also scales DeepSeek's softmax (mscale^2): the export folds the ratio into the queries.
YARN_MSCALE_ROPE = {**YARN_ROPE, "mscale": 1.0, "mscale_all_dim": 1.0}
# case -> (family, source overrides, conversion options, export options)
CASES = {
    "llama-transmla-50": ("llama", {}, dict(method="transmla", kv_budget=0.5, shared_rope=True), {}),
    "llama-transmla-25": ("llama", {}, dict(method="transmla", kv_budget=0.25, shared_rope=True), {}),
    "llama-tied-transmla-25": ("llama", {"tie_word_embeddings": True}, dict(method="transmla", kv_budget=0.25, shared_rope=True), {}),
    "qwen2-bias-transmla-50": ("qwen2", {"bias": True}, dict(method="transmla", kv_budget=0.5, shared_rope=True), {}),
    "mistral-transmla-25": ("mistral", {}, dict(method="transmla", kv_budget=0.25, shared_rope=True), {}),
    "llama-bias-transmla-50": ("llama", {"bias": True}, dict(method="transmla", kv_budget=0.5, shared_rope=True), {}),
    "llama-transmla-qlora": ("llama", {}, dict(method="transmla", kv_budget=0.5, shared_rope=True, q_lora_rank=16), {}),
    "llama-llama3-rope-transmla-25": ("llama", {"rope_parameters": LLAMA3_ROPE}, dict(method="transmla", kv_budget=0.25, shared_rope=True), {}),
    "llama-yarn-rope-transmla-25-all-engines": ("llama", {"rope_parameters": YARN_ROPE}, dict(method="transmla", kv_budget=0.25, shared_rope=True), dict(engines="all", pad_latent=True)),
    "qwen2-yarn-mscale-transmla-50": ("qwen2", {"rope_parameters": YARN_MSCALE_ROPE}, dict(method="transmla", kv_budget=0.5, shared_rope=True), {}),
    "llama-mqa-lossless": ("llama", {"num_key_value_heads": 1}, dict(method="lossless"), {}),
    "llama-mqa-mha2mla": ("llama", {"num_key_value_heads": 1}, dict(method="mha2mla", rope_pairs=2, kv_lora_rank=6, rope_select="uniform"), {}),
    "llama-transmla-25-padded": ("llama", {}, dict(method="transmla", kv_budget=0.25, shared_rope=True), dict(engines="vllm,sglang,transformers", pad_latent=True, pad_width=576)),
    "qwen2-bias-transmla-50-padded-value": ("qwen2", {"bias": True}, dict(method="transmla", kv_budget=0.5, shared_rope=True), dict(pad_value=True)),
    "qwen2-bias-dropped": ("qwen2", {"bias": True}, dict(method="transmla", kv_budget=0.5, shared_rope=True), dict(engines="sglang", drop_biases=True)),
    # Mixtral's router exists in vLLM's DeepSeek MoE only: checked with that router (see STOCK). Its
    # default rms_norm_eps (1e-5) becomes DeepSeek's 1e-6 (measured in the benchmark), so 1e-6 here.
    "mixtral-transmla-vllm": ("mixtral", {"rms_norm_eps": 1e-6}, dict(method="transmla", kv_budget=0.5, shared_rope=True), dict(engines="vllm", pad_latent=True)),
}
LOSSY = {"qwen2-bias-dropped"}  # dropping biases changes the model: measured, not asserted equal


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Every case converted, exported and run once in stock transformers (one subprocess)."""
    root = tmp_path_factory.mktemp("export")
    natives, exports, results = {}, {}, {}
    for i, (name, (family, src_kw, conv, exp)) in enumerate(CASES.items()):
        src = root / f"{name}-src"
        make_tiny_model(family, src, seed=i, **src_kw)
        natives[name] = _convert(src, root / f"{name}-mla", **conv)
        exports[name] = root / f"{name}-ds"
        results[name] = export_deepseek(natives[name], exports[name], ExportOptions(**exp), progress=False)
    save_file({"ids": IDS}, str(root / "ids.safetensors"))
    proc = subprocess.run(
        [sys.executable, str(STOCK), str(root / "ids.safetensors"), str(root), *map(str, exports.values())],
        capture_output=True, text=True, cwd=root, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    infos = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    stock = {name: (info, load_file(str(root / f"{i}.safetensors"))) for i, (name, info) in enumerate(zip(exports, infos))}
    return natives, exports, results, stock


def _native_logits(folder: Path) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        prefill = model(IDS).logits
        out = model(IDS[:, :1], use_cache=True)
        cache, steps = out.past_key_values, [out.logits[:, -1]]
        for t in range(1, IDS.shape[1]):
            out = model(IDS[:, t : t + 1], past_key_values=cache, use_cache=True)
            cache, steps = out.past_key_values, steps + [out.logits[:, -1]]
    return {"prefill": prefill, "decode": torch.stack(steps, 1)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / a.abs().max())


@pytest.mark.parametrize("case", [c for c in CASES if c not in LOSSY])
def test_stock_transformers_equals_native(exported, case):
    natives, exports, results, stock = exported
    info, logits = stock[case]
    assert info["class"] == "DeepseekV3ForCausalLM" and not info["transmla_imported"]
    native = _native_logits(natives[case])
    for kind in ("prefill", "decode"):
        assert _rel(native[kind], logits[kind]) <= 1e-5, (case, kind, _rel(native[kind], logits[kind]))
    # No remote code: a stock model type and no auto_map.
    config = json.loads((exports[case] / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and "auto_map" not in config
    assert (exports[case] / "tokenizer.json").exists() or not (natives[case] / "tokenizer.json").exists()


@pytest.mark.parametrize("case", list(CASES))
def test_stock_transformers_caches_the_latent(exported, case):
    """transformers (5.x) keeps DeepSeek's latent and rope key per token: d_c + d_r values per layer."""
    natives, exports, results, stock = exported
    info, _ = stock[case]
    config = json.loads((exports[case] / "config.json").read_text())
    B, T = IDS.shape
    assert info["cache_keys"] == [B, 1, T, config["kv_lora_rank"]]
    assert info["cache_values"] == [B, 1, T, config["qk_rope_head_dim"]]
    assert config["kv_lora_rank"] + config["qk_rope_head_dim"] == results[case].kv_elements_per_token_per_layer


def test_padded_latent_is_a_width_vllm_accepts(exported):
    """--pad-latent: the smallest width vLLM takes (320 here), or the one --pad-width names (576: the
    one FlashMLA and vLLM's CPU backend take); their logits: test_stock_transformers_equals_native."""
    natives, exports, results, _ = exported
    r = results["llama-yarn-rope-transmla-25-all-engines"]
    assert r.kv_elements_per_token_per_layer == 320 and r.record["padded_latent"]
    r = results["llama-transmla-25-padded"]
    assert r.kv_elements_per_token_per_layer == 576 and r.record["padded_latent"]
    assert r.engines == {"transformers": None, "vllm": None, "sglang": None}


@pytest.mark.parametrize("options, error", [
    (dict(pad_width=576), "pad_width applies only with pad_latent"),
    (dict(pad_latent=True, pad_width=512), "pad_width must be one of 320, 576, got 512"),
])
def test_pad_width_errors(options, error):
    with pytest.raises(ValueError, match=error):
        ExportOptions(**options)


def test_padded_latent_size():
    from transmla.export.engines import padded_latent_size

    assert padded_latent_size(128, 64) == 256 and padded_latent_size(128, 64, 576) == 512
    assert padded_latent_size(300, 64) == 512  # 364 > 320: the next width
    with pytest.raises(ValueError, match="wider than the pad width 320"):
        padded_latent_size(300, 64, 320)
    with pytest.raises(ValueError, match=r"wider than every MLA width vLLM accepts \(320, 576\)"):
        padded_latent_size(600, 64)


def test_padded_value_has_the_key_width_and_the_same_cache(exported):
    """--pad-value (its logits: test_stock_transformers_equals_native, with attention biases carried)."""
    natives, exports, results, _ = exported
    case = "qwen2-bias-transmla-50-padded-value"
    config = json.loads((exports[case] / "config.json").read_text())
    native = json.loads((natives[case] / "config.json").read_text())["mla"]
    assert config["v_head_dim"] == config["qk_nope_head_dim"] + config["qk_rope_head_dim"] > native["v_head_dim"]
    assert results[case].record["padded_value"] and not results[case].record["padded_latent"]
    assert results[case].kv_elements_per_token_per_layer == native["kv_lora_rank"] + native["qk_rope_head_dim"]


def test_yarn_rope_is_carried_for_every_engine(exported):
    """A yarn source keeps its rope type and parameters (DeepseekV3 recomputes the same YaRN grid and
    cos/sin factor on qk_rope_head_dim; the logits match in test_stock_transformers_equals_native), and
    vLLM/SGLang, which turn every scaled rope into DeepSeek-YaRN, compute the same factor here."""
    natives, exports, results, _ = exported
    for case, rope in (("llama-yarn-rope-transmla-25-all-engines", YARN_ROPE), ("qwen2-yarn-mscale-transmla-50", YARN_MSCALE_ROPE)):
        config = json.loads((exports[case] / "config.json").read_text())
        assert config["rope_parameters"] == rope and config["rope_scaling"] == rope, case
    assert results["llama-yarn-rope-transmla-25-all-engines"].engines == {"transformers": None, "vllm": None, "sglang": None}


@pytest.mark.parametrize("rope, reason", [
    (LLAMA3_ROPE, "computes every scaled DeepSeek rope as DeepSeek-YaRN, not llama3"),
    # transformers uses mscale(4, 1) unless both mscale fields are set; DeepSeek-YaRN divides by mscale(4, 1)
    ({**YARN_ROPE, "mscale_all_dim": 1.0}, r"scales the yarn rope's cos/sin by 1 \(DeepSeek-YaRN's mscale ratio\), transformers by 1.13863"),
    ({**YARN_ROPE, "attention_factor": 1.0}, "scales the yarn rope's cos/sin by 1.13863"),
    ({**YARN_ROPE, "truncate": False}, "always truncates the YaRN correction range"),
])
def test_serving_engines_refuse_ropes_they_compute_differently(rope, reason):
    from transmla.export.engines import engine_report

    config = {"num_key_value_heads": 4, "num_attention_heads": 4, "n_routed_experts": 1, "kv_lora_rank": 256,
              "qk_rope_head_dim": 64, "qk_nope_head_dim": 64, "rope_parameters": rope}
    report = engine_report(config)
    assert report["transformers"] is None
    for engine, name in (("vllm", "vLLM"), ("sglang", "SGLang")):
        assert report[engine] is not None and report[engine].startswith(name + " "), report
        assert re.search(reason, report[engine]), report[engine]


def test_dropped_biases_load_everywhere_and_change_little(exported):
    natives, exports, results, stock = exported
    r = results["qwen2-bias-dropped"]
    assert r.record["dropped_biases"] and r.engines["sglang"] is None
    config = json.loads((exports["qwen2-bias-dropped"] / "config.json").read_text())
    assert config["attention_bias"] is False
    native = _native_logits(natives["qwen2-bias-dropped"])["prefill"]
    assert _rel(native, stock["qwen2-bias-dropped"][1]["prefill"]) > 1e-4  # the biases were real


def test_query_bias_travels_through_a_full_rank_q_a(exported):
    natives, exports, results, _ = exported
    config = json.loads((exports["qwen2-bias-transmla-50"] / "config.json").read_text())
    assert config["attention_bias"] and config["q_lora_rank"] == 48 + 1  # hidden size + the constant
    assert results["qwen2-bias-transmla-50"].record["query_bias_via_q_lora"]


# -- refusals: one line, nothing on disk ----------------------------------------------------------


def _nothing_written(out: Path) -> None:
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")]


@pytest.fixture
def native(tmp_path):
    def make(family="llama", src_kw=None, **conv):
        src = tmp_path / f"{family}-src"
        make_tiny_model(family, src, **(src_kw or {}))
        return _convert(src, tmp_path / f"{family}-mla", **conv)

    return make


def test_refuses_rope_frequencies_that_differ_between_layers(native, tmp_path):
    folder = native(method="transmla", kv_budget=0.25, shared_rope=True)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["mla"]["rope_inv_freq"][1] = [f * 0.5 for f in cfg["mla"]["rope_inv_freq"][1]]
    (folder / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out" / "ds"
    out.parent.mkdir()
    with pytest.raises(ExportError, match="differ between layers.*--shared-rope"):
        export_deepseek(folder, out, ExportOptions(), progress=False)
    _nothing_written(out)


def test_refuses_frequencies_off_the_grid(native, tmp_path):
    """Lossless GQA keeps both KV heads' rope pairs: every frequency twice, not one grid."""
    folder = native(method="lossless")
    with pytest.raises(ExportError, match="not one grid"):
        export_deepseek(folder, tmp_path / "ds", ExportOptions(), progress=False)
    _nothing_written(tmp_path / "ds")


def test_refuses_fp16(native, tmp_path):
    folder = native(method="transmla", kv_budget=0.5, shared_rope=True)
    with pytest.raises(ExportError, match="fp16"):
        export_deepseek(folder, tmp_path / "ds", ExportOptions(dtype="fp16"), progress=False)
    _nothing_written(tmp_path / "ds")


def test_refuses_biases_for_an_engine_without_them(native, tmp_path):
    folder = native("qwen2", {"bias": True}, method="transmla", kv_budget=0.5, shared_rope=True)
    with pytest.raises(ExportError, match="sglang has no attention biases.*--drop-biases"):
        export_deepseek(folder, tmp_path / "ds", ExportOptions(engines="sglang"), progress=False)
    _nothing_written(tmp_path / "ds")


def test_refuses_a_width_vllm_rejects_without_padding(native, tmp_path):
    folder = native(method="transmla", kv_budget=0.25, shared_rope=True)
    with pytest.raises(ExportError, match="vllm would not load.*--pad-latent"):
        export_deepseek(folder, tmp_path / "ds", ExportOptions(engines="vllm"), progress=False)
    _nothing_written(tmp_path / "ds")


@pytest.mark.parametrize("engines", ["transformers", "sglang"])
def test_refuses_mixtral_where_no_router_equals_its_own(native, tmp_path, engines):
    folder = native("mixtral", method="transmla", kv_budget=0.5, shared_rope=True)
    reason = "sigmoid" if engines == "transformers" else "always builds a shared expert.*zero-wide"
    with pytest.raises(ExportError, match=f"{engines} would not load.*{reason}.*--engines vllm"):
        export_deepseek(folder, tmp_path / "ds", ExportOptions(engines=engines, pad_latent=True), progress=False)
    _nothing_written(tmp_path / "ds")


def test_mixtral_export_routes_like_mixtral_in_vllm_terms(exported):
    """Every layer sparse, Mixtral's experts under DeepSeek's per-expert names, the router fields
    vLLM reads set to softmax top-k renormalised, and nothing of Mixtral's names left."""
    natives, exports, results, stock = exported
    folder = exports["mixtral-transmla-vllm"]
    config = json.loads((folder / "config.json").read_text())
    assert stock["mixtral-transmla-vllm"][0]["router"] == "vllm softmax"
    assert config["first_k_dense_replace"] == 0 and config["n_shared_experts"] == 0
    assert (config["n_routed_experts"], config["num_experts_per_tok"]) == (4, 2)
    assert config["scoring_func"] == "softmax" and config["norm_topk_prob"] is True
    assert config["topk_method"] == "greedy" and config["routed_scaling_factor"] == 1.0
    tensors = load_file(str(next(folder.glob("*.safetensors"))))
    names = set(tensors)
    assert not any("block_sparse_moe" in n for n in names)
    for e in range(4):
        for part in ("gate_proj", "up_proj", "down_proj"):
            assert f"model.layers.1.mlp.experts.{e}.{part}.weight" in names
    # vLLM (and SGLang) build the shared expert even at n_shared_experts 0, and vLLM's loader refuses a
    # checkpoint that lacks any parameter: its zero-wide weights are written.
    for i in range(2):
        for part, shape in (("gate_proj", [0, 48]), ("up_proj", [0, 48]), ("down_proj", [48, 0])):
            assert list(tensors[f"model.layers.{i}.mlp.shared_experts.{part}.weight"].shape) == shape
    assert results["mixtral-transmla-vllm"].engines["vllm"] is None
    assert "sigmoid" in results["mixtral-transmla-vllm"].engines["transformers"]
    assert "silu_and_mul divides by its width" in results["mixtral-transmla-vllm"].engines["sglang"]


def test_transmla_exports_by_default_and_per_layer_rope_is_the_opt_in(native, tiny_factory, tmp_path):
    """The default conversion has one rope grid in every layer (it exports); shared_rope=False (the CLI's
    --per-layer-rope) lets each layer choose, and --format deepseek refuses it before converting."""
    folder = native(method="transmla", kv_budget=0.25)
    assert json.loads((folder / "config.json").read_text())["mla"]["method"]["plan"]["selection"] == "grid"
    export_deepseek(folder, tmp_path / "ds", ExportOptions(), progress=False)
    per_layer = native("mistral", method="transmla", kv_budget=0.25, shared_rope=False)
    assert json.loads((per_layer / "config.json").read_text())["mla"]["method"]["plan"]["selection"] == "score"
    _, src = tiny_factory("llama")
    options = ConvertOptions.of(method="transmla", kv_budget=0.25, shared_rope=False, format="deepseek")
    with pytest.raises(ValueError, match="needs one rope grid shared by all layers"):
        convert(str(src), tmp_path / "refused", options, progress=False)
    assert not (tmp_path / "refused").exists()


def test_shared_rope_is_refused_where_a_method_cannot_share_one_grid(tiny_factory, tmp_path):
    _, src = tiny_factory("llama")
    with pytest.raises(ValueError, match="lossless keeps the rope pairs of all 2 KV heads"):
        convert(str(src), tmp_path / "out", ConvertOptions.of(method="lossless", format="deepseek"), progress=False)


def test_engine_shape_note_names_the_fast_engines_or_the_nearest_shape():
    from transmla.export.engines import engine_shape_note

    # prompts too: -mla 1 -fa 1 keeps them absorbed, at the decode widths
    assert engine_shape_note(128, 64, 64, 64, 384) == "fast kernels in ik_llama.cpp flash MLA, ik_llama.cpp prompts"
    assert engine_shape_note(256, 64, 64, 64, 512) == "fast kernels in ik_llama.cpp flash MLA, ik_llama.cpp prompts, vLLM MLA"
    assert "the nearest: -R 128 -r 64, 50.0% of the source's cache" in engine_shape_note(64, 32, 64, 64, 384)


def test_norm_trick_bound_holds_for_any_input():
    """The scale keeps s^2 mean(c^2) / eps tiny for every x the input norm can produce."""
    torch.manual_seed(0)
    w, b, ln = torch.randn(12, 40), torch.randn(12), torch.rand(40) * 3
    s = norm_trick_scale(w, b, ln, 12)
    h = torch.randn(1000, 40) * torch.logspace(-3, 3, 1000)[:, None]
    x = ln * h / h.pow(2).mean(-1, keepdim=True).sqrt()
    c = (x @ w.T + b).double()
    assert float((s * c).pow(2).mean(-1).max()) / 1e-6 <= 1e-9
    assert s == 2.0 ** round(torch.log2(torch.tensor(s)).item())  # a power of two: exact in any dtype


# -- the CLI ------------------------------------------------------------------------------------


def test_cli_convert_format_deepseek_equals_export_of_shared_rope(cli, tmp_path):
    """`convert --format deepseek` in one step gives the export of a `--shared-rope` conversion."""
    src = tmp_path / "src"
    make_tiny_model("llama", src)
    save_word_tokenizer(src)
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"w{(i * 7) % 96}" for i in range(4000)))
    common = ["--method", "transmla", "--kv-budget", "0.25", "--calib", text, "--calib-samples", "8", "--calib-seq-len", "16", "--device", "cpu"]
    code, out, err = cli("convert", src, tmp_path / "one", *common, "--format", "deepseek", "--json")
    assert code == 0, err
    assert json.loads(out)["kv_elements_per_token_per_layer"] == 8
    code, out, err = cli("convert", src, tmp_path / "mla", *common, "--shared-rope", "--json")
    assert code == 0, err  # the summary names the engine shape nearest to its cache: rope 64 + latent 128 here
    assert "the nearest: -R 128 -r 64, 600.0% of the source's cache" in json.loads(out)["engines"]
    code, out, err = cli("convert", src, tmp_path / "own", *common, "--per-layer-rope", "--json")
    assert code == 0 and "engines" not in json.loads(out), err  # per-layer rope runs in no engine
    code, out, err = cli("export", tmp_path / "mla", tmp_path / "two", "--json")
    assert code == 0, err
    a, b = load_file(str(tmp_path / "one" / "model.safetensors")), load_file(str(tmp_path / "two" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # the native intermediate is gone
    code, out, err = cli("inspect", tmp_path / "one", "--json")
    info = json.loads(out)
    assert code == 0 and info["kv_elements_per_token_per_layer"] == 8 and info["attention"] == "MLA"
    assert info["loads in transformers"] == "yes" and info["loads in vllm"].startswith("no: vLLM's MLA backends accept")


def _per_layer_frequencies(folder: Path) -> Path:
    cfg = json.loads((folder / "config.json").read_text())
    cfg["mla"]["rope_inv_freq"][1] = [f * 0.5 for f in cfg["mla"]["rope_inv_freq"][1]]
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


# refusal -> (source family and overrides, conversion, export flags, edit of the native folder, the fix named)
CLI_REFUSALS = {
    "off-grid": ("llama", {}, dict(method="lossless"), [], None, "not one grid.*--shared-rope"),
    "fp16": ("llama", {}, dict(method="transmla", kv_budget=0.5, shared_rope=True), ["--dtype", "fp16"], None, "fp16.*fp32 or bf16"),
    "biases-sglang": ("qwen2", {"bias": True}, dict(method="transmla", kv_budget=0.5, shared_rope=True), ["--engines", "sglang"], None, "sglang has no attention biases.*--drop-biases"),
    "vllm-width": ("llama", {}, dict(method="transmla", kv_budget=0.25, shared_rope=True), ["--engines", "vllm"], None, "vllm would not load.*--pad-latent"),
    "gguf-engines": ("llama", {}, dict(method="transmla", kv_budget=0.5, shared_rope=True), ["--format", "gguf", "--engines", "vllm"], None, "--engines applies to --format deepseek only"),
    "gguf-ik-pad-width": ("llama", {}, dict(method="transmla", kv_budget=0.5, shared_rope=True), ["--format", "gguf-ik", "--pad-latent", "--pad-width", "576"], None, "--pad-latent applies to --format deepseek only"),
    "per-layer-frequencies": ("llama", {}, dict(method="transmla", kv_budget=0.25, shared_rope=True), [], _per_layer_frequencies, "differ between layers.*--shared-rope"),
}


@pytest.mark.parametrize("case", list(CLI_REFUSALS))
def test_cli_export_error_is_one_line(cli, native, tmp_path, case):
    family, src_kw, conv, flags, edit, fix = CLI_REFUSALS[case]
    folder = native(family, src_kw, **conv)
    if edit is not None:
        edit(folder)
    out = tmp_path / "out" / "ds"
    out.parent.mkdir()
    code, _, err = cli("export", folder, out, *flags)
    assert code == 1 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert re.search(fix, err), err
    _nothing_written(out)


def test_cli_convert_format_deepseek_takes_the_export_options(cli, tmp_path):
    """`convert --format deepseek` takes export's --engines, --pad-latent and --drop-biases."""
    src = tmp_path / "src"
    make_tiny_model("llama", src, bias=True)  # Llama with attention biases (Qwen2 would load its own tokenizer class)
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"w{(i * 7) % 96}" for i in range(4000)))
    save_word_tokenizer(src)
    code, out, err = cli("convert", src, tmp_path / "ds", "--method", "transmla", "--kv-budget", "0.25", "--calib", text,
                         "--calib-samples", "8", "--calib-seq-len", "16", "--device", "cpu", "--format", "deepseek",
                         "--engines", "all", "--pad-latent", "--drop-biases", "--json")
    assert code == 0, err
    assert json.loads(out)["kv_elements_per_token_per_layer"] == 320
    config = json.loads((tmp_path / "ds" / "config.json").read_text())
    assert config["kv_lora_rank"] + config["qk_rope_head_dim"] == 320 and config["attention_bias"] is False
    record = config["transmla_export"]
    assert record["engines"] == ["transformers", "vllm", "sglang"] and record["dropped_biases"] and record["padded_latent"]


def _fp16_source(path: Path) -> None:
    make_tiny_model("llama", path).half().save_pretrained(path)


# refusal -> (make the source, convert flags, the one line it prints)
CONVERT_REFUSALS = {
    "biases-sglang": (lambda p: make_tiny_model("qwen2", p, bias=True), ["--engines", "sglang"], "sglang has no attention biases.*--drop-biases"),
    "mixtral-transformers": (lambda p: make_tiny_model("mixtral", p), [], "transformers would not load.*sigmoid.*--engines vllm"),
    "mixtral-sglang": (lambda p: make_tiny_model("mixtral", p), ["--engines", "sglang", "--pad-latent"], "sglang would not load.*zero-wide"),
    "llama3-rope-vllm": (lambda p: make_tiny_model("llama", p, rope_parameters=LLAMA3_ROPE), ["--engines", "vllm", "--pad-latent"], "vllm would not load.*not llama3"),
    "fp16": (_fp16_source, [], "fp16.*--dtype fp32 or bf16"),
}


@pytest.mark.parametrize("case", list(CONVERT_REFUSALS))
def test_cli_convert_format_deepseek_refuses_before_converting(cli, tmp_path, monkeypatch, case):
    """What the source decides is refused before the conversion starts: one line, nothing on disk."""
    import transmla.convert.api as api

    def never(*args, **kwargs):
        raise AssertionError("the conversion started")

    monkeypatch.setattr(api, "LayerStream", never)
    make, flags, message = CONVERT_REFUSALS[case]
    make(tmp_path / "src")
    code, _, err = cli("convert", tmp_path / "src", tmp_path / "ds", "--method", "transmla", "--kv-budget", "0.5",
                       "--device", "cpu", "--format", "deepseek", *flags)
    assert code == 1 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert re.search(message, err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_cli_export_options_need_format_deepseek(cli, tiny_factory, tmp_path):
    _, src = tiny_factory("llama")
    code, _, err = cli("convert", src, tmp_path / "out", "--pad-latent")
    assert code == 1 and "--pad-latent does not apply to format native" in err and not (tmp_path / "out").exists()


def test_rms_norm_eps_becomes_deepseeks_and_that_alone_changes_the_model(native, tmp_path):
    """A source with rms_norm_eps 1e-5 exports with 1e-6 (the eps transformers fixes for the latent
    norm) on every norm: the export equals the native model run at 1e-6. Against the native model at
    its own 1e-5 the tiny random model moves by a max relative logit error of 1.4e-2 (measured; its
    embeddings have std 0.02, so mean(h^2) ~ 4e-4 and eps 1e-5 is not negligible there); the
    SmolLM2 perplexity change is in the benchmark."""
    folder = native(src_kw={"rms_norm_eps": 1e-5}, method="transmla", kv_budget=0.5, shared_rope=True)
    result = export_deepseek(folder, tmp_path / "ds", ExportOptions(), progress=False)
    config = json.loads((tmp_path / "ds" / "config.json").read_text())
    assert config["rms_norm_eps"] == 1e-6
    assert result.record["source_rms_norm_eps"] == 1e-5 and result.record["rms_norm_eps_changed"]
    with torch.no_grad():
        ds = AutoModelForCausalLM.from_pretrained(tmp_path / "ds", dtype=torch.float32).eval()(IDS).logits
        at_1e5 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()(IDS).logits
        at_1e6 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, rms_norm_eps=1e-6).eval()(IDS).logits
    assert _rel(at_1e6, ds) <= 1e-5
    assert _rel(at_1e5, ds) > 1e-3  # the eps change is the whole difference, and it is real here


def test_bf16_export_is_within_bf16_noise(native, tmp_path):
    """bf16 keeps the scaled latent rows (fp16 would not): the export stays as close to the native
    model as the native model's own bf16 copy is."""
    folder = native("qwen2", {"bias": True}, method="transmla", kv_budget=0.5, shared_rope=True)
    export_deepseek(folder, tmp_path / "ds", ExportOptions(dtype="bf16"), progress=False)
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()(IDS).logits
        own = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()(IDS).logits.float()
        ds = AutoModelForCausalLM.from_pretrained(tmp_path / "ds", dtype=torch.bfloat16).eval()(IDS).logits.float()
    assert torch.isfinite(ds).all()
    assert _rel(ref, ds) <= 3 * max(_rel(ref, own), 1e-3)
