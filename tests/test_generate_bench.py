"""`transmla bench generate`: end-to-end decode speed and cache of an MLA model against its source,
on tiny random checkpoints (no timing thresholds: only fields, cache bytes and error paths)."""

from __future__ import annotations

import json

import pytest

from transmla.checkpoint.resolve import load_config
from transmla.bench.generate import bench_generate, find_recorded_source
from transmla.mla.packed_linear import onednn_linear_available

from test_cpu_decode_kernel import HAS_AMX

B, T, N = 2, 16, 4  # batch, context, new tokens: small and fast

ROW_FIELDS = {
    "model", "attention", "batch", "context", "new_tokens", "dtype", "device", "prefill_seconds",
    "decode_seconds", "decode_tokens_per_second", "ms_per_step", "kv_elements_per_token_per_layer",
    "kv_bytes_per_token_per_layer", "layers", "cached_tokens", "cache_bytes", "formula_cache_bytes",
    "peak_memory_bytes", "decode_mode", "cache", "repeats", "prefill_seconds_median", "decode_seconds_median",
    "ms_per_step_median", "model_bytes", "bytes_per_step", "linears",
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny GQA Llama with a tokenizer, its lossless conversion and a compressed (mha2mla, half cache) one."""
    from conftest import make_tiny_model, save_word_tokenizer

    from transmla.convert.api import convert
    from transmla.convert.options import ConvertOptions

    root = tmp_path_factory.mktemp("genbench")
    src = root / "src"
    make_tiny_model("llama", src)
    save_word_tokenizer(src)
    lossless, small = root / "lossless", root / "small"
    convert(str(src), lossless, ConvertOptions.of(method="lossless"), progress=False)
    convert(str(src), small, ConvertOptions.of(method="mha2mla", kv_budget=0.5), progress=False)
    return {"src": src, "lossless": lossless, "small": small}


def _check_row(row: dict, attention: str) -> None:
    assert ROW_FIELDS <= row.keys()
    assert row["attention"] == attention
    assert (row["batch"], row["context"], row["new_tokens"]) == (B, T, N)
    assert (row["dtype"], row["device"]) == ("fp32", "cpu")
    assert row["cached_tokens"] == T + N
    assert row["cache_bytes"] == row["formula_cache_bytes"] > 0
    assert row["formula_cache_bytes"] == row["kv_bytes_per_token_per_layer"] * row["layers"] * (T + N) * B
    assert row["decode_tokens_per_second"] > 0 and row["prefill_seconds"] > 0 and row["ms_per_step"] > 0
    assert row["prefill_seconds"] <= row["prefill_seconds_median"] and row["ms_per_step"] <= row["ms_per_step_median"]
    assert row["decode_seconds"] == min(row["decode_seconds_all"]) and len(row["decode_seconds_all"]) == row["repeats"]
    assert row["bytes_per_step"] == row["model_bytes"] + row["kv_bytes_per_token_per_layer"] * row["layers"] * T * B
    assert row["peak_memory_bytes"] is None  # CPU


def test_lossless_against_source(tiny):
    result = bench_generate(str(tiny["lossless"]), str(tiny["src"]), batch=B, context=T, new_tokens=N, device="cpu")
    assert {"machine", "torch", "transformers", "load_average", "load_average_after"} <= result["environment"].keys()
    mla, dynamic, static = result["rows"]
    _check_row(mla, "MLA")
    for src in (dynamic, static):
        _check_row(src, "GQA")
        assert src["decode_mode"] is None and src["model"] == str(tiny["src"])
        assert "speedup_vs_source" not in src
    assert (mla["cache"], dynamic["cache"], static["cache"]) == ("latent", "dynamic", "static")
    assert mla["decode_mode"] == "auto" and mla["model"] == str(tiny["lossless"])
    assert mla["linears"] == ("onednn-packed" if onednn_linear_available() else "plain")
    assert dynamic["linears"] == static["linears"] == "plain (stock)"
    m = load_config(tiny["lossless"]).mla  # the C kernels run where the shape fits (cpu_build.fits)
    fits = m["kv_lora_rank"] % 16 == 0 and m["qk_rope_head_dim"] % 16 == 0
    assert mla["decode_attention"] == mla["prefill_attention"] == ("c-kernel" if fits else "sdpa")
    for src in (dynamic, static):
        assert src["decode_attention"] == src["prefill_attention"] == "stock"
    bf16 = bench_generate(str(tiny["lossless"]), str(tiny["src"]), batch=B, context=T, new_tokens=N, device="cpu",
                          dtype="bf16", repeats=1, source_caches=("static",))["rows"][0]
    amx = fits and HAS_AMX and load_config(tiny["lossless"]).num_attention_heads <= 16  # the AMX kernels (bf16)
    assert bf16["decode_attention"] == bf16["prefill_attention"] == ("amx-kernel" if amx else "sdpa")
    best = max((dynamic, static), key=lambda r: r["decode_tokens_per_second"])
    assert mla["source_cache"] == best["cache"]
    assert mla["speedup_vs_source"] == mla["decode_tokens_per_second"] / best["decode_tokens_per_second"]
    assert mla["ideal_speedup"] == best["bytes_per_step"] / mla["bytes_per_step"]
    assert mla["prefill_ratio_vs_source"] == mla["prefill_seconds"] / min(dynamic["prefill_seconds"], static["prefill_seconds"])
    assert mla["cache_ratio_vs_source"] == mla["cache_bytes"] / best["cache_bytes"]


def test_random_fill_decode_only_beyond_positions(tiny):
    """--no-prefill: the cache holds random values of the right size, only decode is timed; the
    position limit (256 here) may be passed for a speed measurement."""
    result = bench_generate(str(tiny["small"]), str(tiny["src"]), batch=1, context=300, new_tokens=2, device="cpu",
                            repeats=2, prefill=False, source_caches=("dynamic",), beyond_positions=True)
    mla, src = result["rows"]
    assert result["environment"]["beyond_trained_positions"] is True
    for row in (mla, src):
        assert row["prefill"] is False and row["prefill_seconds"] is None and row["repeats"] == 2
        assert row["cached_tokens"] == 302 and row["cache_bytes"] == row["formula_cache_bytes"]
    assert "prefill_ratio_vs_source" not in mla and mla["source_cache"] == "dynamic"


def test_plain_linears_on_request(tiny):
    """packed_linears=False: the MLA model's linears run through F.linear, and the row says so."""
    result = bench_generate(str(tiny["small"]), str(tiny["src"]), batch=1, context=8, new_tokens=2, device="cpu",
                            repeats=1, source_caches=("dynamic",), packed_linears=False)
    assert result["rows"][0]["linears"] == "plain"


def test_profile_of_decode_steps(tiny, cli):
    """profile_steps: each row lists where its profiled decode steps went (largest self times first,
    then the time outside torch ops), all within the profiled wall time."""
    from transmla.bench.generate import PROFILE_TOP

    result = bench_generate(str(tiny["small"]), str(tiny["src"]), batch=1, context=12, new_tokens=2, device="cpu",
                            repeats=1, source_caches=("static",), threads=1, profile_steps=3)
    for row in result["rows"]:
        prof = row["profile"]
        assert prof["steps"] == 3 and prof["ms_per_step"] > 0
        ops = prof["ops"]
        assert 2 <= len(ops) <= PROFILE_TOP + 1 and ops[-1]["op"] == "(outside torch ops)"
        assert [o["ms_per_step"] for o in ops[:-1]] == sorted((o["ms_per_step"] for o in ops[:-1]), reverse=True)
        assert all(o["ms_per_step"] >= 0 and o["share"] == pytest.approx(o["ms_per_step"] / prof["ms_per_step"])
                   for o in ops)
        assert sum(o["share"] for o in ops) <= 1 + 1e-6
        assert any(o["op"].startswith("aten::") for o in ops)
    code, out, err = cli("bench", "generate", tiny["small"], "--source", tiny["src"], "--batch", 1, "--context", 8,
                         "--new-tokens", 2, "--device", "cpu", "--repeats", 1, "--source-cache", "static",
                         "--profile-steps", 2)
    assert code == 0, err
    assert out.count("decode steps profiled") == 2 and "(outside torch ops)" in out
    assert "profile" not in bench_generate(str(tiny["small"]), str(tiny["src"]), batch=1, context=8, new_tokens=1,
                                           device="cpu", repeats=1, source_caches=("static",))["rows"][0]


def test_compressed_source_found_from_config(tiny):
    """No --source: the path the conversion recorded is used; a half-budget model caches less."""
    from transmla.checkpoint.resolve import load_config

    assert find_recorded_source(load_config(tiny["small"])) == str(tiny["src"])
    result = bench_generate(str(tiny["small"]), batch=B, context=T, new_tokens=N, device="cpu",
                            source_caches=("static",))
    mla, src = result["rows"]
    _check_row(mla, "MLA")
    _check_row(src, "GQA")
    assert src["model"] == str(tiny["src"])
    assert mla["cache_ratio_vs_source"] < 1


def test_source_alone(tiny):
    result = bench_generate(str(tiny["src"]), batch=B, context=T, new_tokens=N, device="cpu")
    assert [r["cache"] for r in result["rows"]] == ["dynamic", "static"]  # a model that is not MLA: each stock cache
    for row in result["rows"]:
        _check_row(row, "GQA")


def test_recorded_source_missing(tiny, tmp_path):
    """An MLA model whose recorded source is gone needs --source."""
    import shutil

    moved = tmp_path / "mla"
    shutil.copytree(tiny["lossless"], moved)
    cfg_path = moved / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["mla"]["method"]["source"] = str(tmp_path / "gone")
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="give --source"):
        bench_generate(str(moved), batch=B, context=T, new_tokens=N, device="cpu")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"batch": 0}, "batch must be at least 1"),
        ({"context": 0}, "context must be at least 1"),
        ({"new_tokens": 0}, "new_tokens must be at least 1"),
        ({"dtype": "fp8"}, "dtype must be one of"),
        ({"context": 250, "new_tokens": 10}, "max_position_embeddings"),
        ({"repeats": 0}, "repeats must be at least 1"),
        ({"source_caches": ("sliding",)}, "unknown source cache"),
        ({"profile_steps": -1}, "profile_steps must be at least 0"),
    ],
)
def test_bad_arguments(tiny, kwargs, message):
    args = {"batch": B, "context": T, "new_tokens": N, "device": "cpu", **kwargs}
    with pytest.raises(ValueError, match=message):
        bench_generate(str(tiny["lossless"]), str(tiny["src"]), **args)


def test_cli_json_and_table(tiny, cli):
    code, out, err = cli("bench", "generate", tiny["small"], "--source", tiny["src"], "--batch", B, "--context", T,
                         "--new-tokens", N, "--device", "cpu", "--repeats", 2, "--source-cache", "static", "--threads", 1, "--json")
    assert code == 0, err
    mla, src = json.loads(out)["rows"]
    assert mla["repeats"] == src["repeats"] == 2 and src["cache"] == "static"
    assert json.loads(out)["environment"]["threads"] == 1
    assert mla["cache_bytes"] == mla["formula_cache_bytes"] and src["cache_bytes"] == src["formula_cache_bytes"]
    assert mla["cache_ratio_vs_source"] < 1
    code, out, err = cli("bench", "generate", tiny["lossless"], "--batch", 1, "--context", 8, "--new-tokens", 2,
                         "--device", "cpu")
    assert code == 0, err
    assert "tokens/s" in out and "MLA" in out and "GQA" in out and "(static)" in out and "load" in out
    assert "decode attention" in out and ("sdpa" in out or "c-kernel" in out)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--batch", "0"], "batch must be at least 1"),
        (["--dtype", "int4"], "dtype must be one of"),
    ],
)
def test_cli_bad_input(tiny, cli, args, message):
    code, out, err = cli("bench", "generate", tiny["lossless"], "--source", tiny["src"], "--device", "cpu", *args)
    assert code == 1 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], err


def test_cli_missing_path(tmp_path, cli):
    code, out, err = cli("bench", "generate", tmp_path / "nope", "--device", "cpu")
    assert code == 1 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "no such file or directory" in lines[0], err


def test_long_steps_report_where_they_are_also_with_json(tiny, cli, monkeypatch):
    """Every timed repetition says which model, which step and which repetition it is on stderr, with
    periodic lines and, after the first repetition, an estimate; --json keeps stdout for the JSON."""
    import json
    import time as _time

    import transmla.bench.generate as gb

    monkeypatch.setenv("TRANSMLA_PROGRESS_SECONDS", "0.05")
    real_run = gb._run

    def slow_run(*args, **kwargs):  # long enough for the periodic lines of a slow machine
        _time.sleep(0.3)
        return real_run(*args, **kwargs)

    monkeypatch.setattr(gb, "_run", slow_run)
    code, out, err = cli("bench", "generate", tiny["small"], "--source", tiny["src"], "--batch", 1, "--context", 8,
                         "--new-tokens", 2, "--device", "cpu", "--repeats", 2, "--source-cache", "static", "--json")
    assert code == 0, err
    assert len(json.loads(out)["rows"]) == 2
    lines = err.splitlines()
    for spec in (tiny["small"], tiny["src"]):
        first = [x for x in lines if x.startswith(f"{spec}: ") and "repetition 1/2" in x]
        second = [x for x in lines if x.startswith(f"{spec}: ") and "repetition 2/2" in x]
        assert "eta ?" in first[0] and first[-1].endswith("done)"), first
        assert len(first) >= 3, first  # start, at least one periodic line, end
        assert "eta 0:00:00" in second[0] and second[-1].endswith("done)"), second  # estimated from the first
