"""benchmarks.fit_cost times a conversion's stages, also of its first layers only (issue 36)."""

from benchmarks.fit_cost import STAGES, run

from conftest import make_tiny_model, save_word_tokenizer


def test_fit_cost_times_the_first_layers_and_writes_nothing(tmp_path):
    src = tmp_path / "src"
    make_tiny_model("llama", src, num_hidden_layers=3)
    save_word_tokenizer(src)
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"w{(i * 7) % 96}" for i in range(4000)))
    options = ("--calib", str(text), "--calib-samples", "8", "--calib-seq-len", "16", "--fit-steps", "2", "--device", "cpu")
    out = tmp_path / "out"
    row = run(0.25, False, False, out, model=str(src), layers=2, options=options)
    assert not out.exists()  # stopped at layer 2 of 3: the CLI wrote nothing
    assert row["layers_timed"] == 2
    assert set(row["stages"]) == set(STAGES) | {"the rest"}
    assert row["stages"]["source forward"] > 0 and row["stages"]["fit Adam"] > 0
    assert abs(sum(row["stages"].values()) - row["wall_seconds"]) < 0.5  # the rest is what the stages leave
    assert row["fit_rates"] == "relative"  # 25%: the CLI's relative-rate fit, read from the settings that ran
    full = run(0.25, False, False, out, model=str(src), options=options)
    assert (out / "config.json").exists() and full["layers_timed"] == "all"
