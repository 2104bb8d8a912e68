"""Adding a conversion method is one folder and one registry line: a 20-line example method
(TransMLA exactly as published, its fold a setting) runs through the production pipeline, and
its settings become CLI flags, recipe keys and sweep settings without touching anything else."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import transmla  # noqa: F401  (registers the MLA models)
from transmla.cli.options import flag_message, schema_flags
from transmla.convert import registry
from transmla.convert.assemble import assemble_model
from transmla.convert.calibrate import collect_layer_stats
from transmla.convert.layers import source_layers
from transmla.convert.method import ConversionMethod, StatsNeeds
from transmla.convert.options import ConvertOptions
from transmla.convert.pipeline import LayerStream, write_mla_checkpoint
from transmla.convert.transmla.method import TransMLAOptions, convert_layer, published_plan, resolve_shape
from transmla.eval.perplexity import perplexity
from transmla.schema import option
from transmla.sweep import options_for


# --- the example: what convert/published/method.py would hold ---------------------------------------
@dataclass
class PublishedOptions:
    kv_budget: float | None = option(None, "Fraction of the source KV cache to keep.")
    fold: int = option(2, "published: frequencies folded per PCA group.")


class Published(ConversionMethod):
    name = "published"
    help = "TransMLA exactly as published"
    Options = PublishedOptions

    def plan(self, geometry, options):
        R, r = resolve_shape(TransMLAOptions(kv_budget=options.kv_budget, shared_rope=False), geometry)
        return published_plan(R, r, options.fold)

    def needs(self, plan):
        return StatsNeeds(gram=True)

    def convert_layer(self, plan, source, stats):
        return convert_layer(source, stats.gram, plan)
# --- and the registry line: METHODS gets Published() --------------------------------------------------


def test_a_new_method_is_one_class_and_one_registry_line(tiny_factory, tmp_path, monkeypatch):
    monkeypatch.setitem(registry.METHODS, "published", Published())
    _, path = tiny_factory("llama")
    config = AutoConfig.from_pretrained(path)
    calib = torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(1))
    options = ConvertOptions.of("published", kv_budget=0.5, fold=4, device="cpu")
    layers = LayerStream(registry.get_method("published"), path, config, options, progress=False, calib_ids=calib)
    result = write_mla_checkpoint(path, config, tmp_path / "out", layers, layers.record, progress=False)
    assert result.kv_elements_per_token_per_layer == 16  # half of 2 * 2 KV heads * 8
    record = layers.record()
    assert record["name"] == "published" and record["plan"]["selection"] == "uniform" and record["plan"]["freqfold"] == 4
    assert [info["freqfold"] for info in record["layers"]] == [4, 4]

    # the written model is the published TransMLA math applied layer by layer
    stats = collect_layer_stats(path, config, calib, progress=False)
    plan = published_plan(12, 4, 4)
    reference = assemble_model(path, config, [convert_layer(s, st.gram, plan)[0] for s, st in zip(source_layers(path, config), stats)])
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    ids = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=1e-5, rtol=1e-5)
    # and it evaluates like any converted model: the same perplexity as the reference math
    stream = torch.randint(0, 97, (4 * 16,), generator=torch.Generator().manual_seed(3))  # [64]
    scored = perplexity(model, stream, seq_len=16, progress=False)
    assert scored.windows == 4 and math.isfinite(scored.perplexity)
    assert scored.perplexity == pytest.approx(perplexity(reference, stream, seq_len=16, progress=False).perplexity, rel=1e-5)

    # its settings are flags, sweep settings and validated names, with nothing else edited
    assert [f.decls for f in schema_flags(Published.Options)] == [("--kv-budget",), ("--fold",)]
    assert options_for("published", 0.25, {"fold": 8, "svd": "split"}).settings == PublishedOptions(0.25, 8)
    with pytest.raises(ValueError) as refused:
        ConvertOptions.of("published", rope_dim=4)
    assert flag_message(str(refused.value), {"rope_dim": "--rope-dim"}) == "--rope-dim does not apply to method published"
