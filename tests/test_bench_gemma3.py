"""benchmarks.gemma3's screen with the CLI's fit settings changed: the far term on the layers without a sliding
window (issue 37's next run), on a tiny random Gemma 3."""

import json

from transformers import AutoConfig

from benchmarks.gemma3 import _convert_with_plan
from transmla.families import unwindowed_layers
from transmla.convert.options import ConvertOptions

from conftest import make_tiny_model, save_word_tokenizer

KINDS = ["sliding_attention", "sliding_attention", "full_attention"] * 2


def test_far_term_on_the_global_layers(tmp_path, monkeypatch):
    import transmla.convert.pipeline as pipeline

    fitted_far = []  # the layers whose fit ran with the far term
    fit_layer = pipeline.fit_layer

    def spy(config, layer, x, z, settings, index=0, *args, **kwargs):
        if settings.far and index in settings.far_layers:
            fitted_far.append(index)
        return fit_layer(config, layer, x, z, settings, index, *args, **kwargs)

    monkeypatch.setattr(pipeline, "fit_layer", spy)
    src = tmp_path / "src"
    make_tiny_model("gemma3_text", src, num_hidden_layers=6, layer_types=KINDS, sliding_window=8)
    save_word_tokenizer(src)
    config = AutoConfig.from_pretrained(src)
    assert unwindowed_layers(config) == (2, 5)
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"w{(i * 7) % 96}" for i in range(6000)))
    options = ConvertOptions.of(method="transmla", kv_budget=0.5, calib=str(text), calib_samples=8, calib_seq_len=16,
                                fit_steps=2, force=True)
    out = tmp_path / "out"
    _convert_with_plan(src, out, options, {}, {"far_layers": "global"})
    fit = json.loads((out / "config.json").read_text())["mla"]["method"]["calibration"]["fit"]
    assert fit["far"] == 256 and fit["far_layers"] == [2, 5]  # the CLI's far term, moved to the global layers
    assert fitted_far == [2, 5]  # and the fits ran so
    # the CLI's own fit settings now choose the same layers for a source with sliding windows (L/2 .. 5L/6 would
    # be 3 and 4), and keep L/2 .. 5L/6 where no layer has a window
    from transmla.convert.pipeline import LayerStream
    from transmla.convert.registry import get_method

    assert LayerStream(get_method("transmla"), src, config, options, progress=False).fit.far_layers == (2, 5)
    plain = tmp_path / "plain"
    make_tiny_model("gemma3_text", plain, num_hidden_layers=6, layer_types=["full_attention"] * 6, sliding_window=8)
    save_word_tokenizer(plain)
    plain_config = AutoConfig.from_pretrained(plain)
    assert unwindowed_layers(plain_config) == ()
    assert LayerStream(get_method("transmla"), plain, plain_config, options, progress=False).fit.far_layers == (3, 4)


def test_hybrid_takes_only_the_global_layers(tmp_path):
    """The source with its global layers' attention from a conversion: equal to the source where that conversion
    is lossless; with a lossy one it differs from the source and from the whole conversion alike."""
    import torch

    from benchmarks.gemma3 import _load, hybrid_cache, hybrid_model
    from transmla.convert.api import convert

    src = tmp_path / "src"
    make_tiny_model("gemma3_text", src, num_hidden_layers=6, layer_types=KINDS, sliding_window=8)
    save_word_tokenizer(src)
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"w{(i * 7) % 96}" for i in range(6000)))
    config = AutoConfig.from_pretrained(src)
    layers = unwindowed_layers(config)
    ids = torch.randint(0, config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))  # longer than the window
    with torch.no_grad():
        source = _load(src)(ids).logits
        convert(str(src), tmp_path / "lossless", ConvertOptions.of(method="lossless"), progress=False)
        same = hybrid_model(src, tmp_path / "lossless", layers)(ids).logits
        torch.testing.assert_close(same, source, rtol=1e-5, atol=1e-5)
        convert(str(src), tmp_path / "lossy", ConvertOptions.of(method="transmla", kv_budget=0.25, fit_steps=0,
                                                                 calib=str(text), calib_samples=8, calib_seq_len=16),
                progress=False)
        mixed = hybrid_model(src, tmp_path / "lossy", layers)(ids).logits
        whole = _load(tmp_path / "lossy")(ids).logits
    assert (mixed - source).abs().max() > 1e-3 and (mixed - whole).abs().max() > 1e-3
    # 4 sliding layers see 8 rows, 2 global layers all 64 at half the width: (4*8 + 2*64/2) / (4*8 + 2*64)
    assert hybrid_cache(config, 1, 2, 64) == (4 * 8 * 2 + 2 * 64 * 1) / ((4 * 8 + 2 * 64) * 2)
