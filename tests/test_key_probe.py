"""The passkey likelihood probe (transmla.eval.key_probe) and the conversion stages that use it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import make_tiny_model
from test_passkey import VOCAB, filler_file, word_tokenizer
from transmla.eval import passkey as pk
from transmla.eval.key_probe import key_probe, key_tokens


def _settings(filler, **kw):
    return pk.PasskeySettings(**({"depths": "10,90", "keys": 2, "filler": str(filler)} | kw))


def test_probe_is_the_key_likelihood_of_the_whole_sequence(tmp_path):
    """Its NLL equals cross-entropy over the full logits of prompt + key (independent indexing), and a
    teacher-forced exact match is a greedy answer that starts with the key."""
    tok, filler = word_tokenizer(), filler_file(tmp_path / "f.txt")
    net = make_tiny_model("llama", vocab_size=len(VOCAB))
    settings = _settings(filler)
    result = key_probe(net, tok, settings, [64, 96])
    assert result["keys"] == 2 * 2 * 2 and len(result["cells"]) == 4
    paragraphs = pk.filler_paragraphs(settings.filler)
    for t, cell in zip(pk.trials([64, 96], settings.depth_list, 2, settings.seed, len(paragraphs))[::2], result["cells"]):
        assert (cell["length"], cell["depth"]) == (t.length, t.depth)
    nlls, exact = [], 0
    answer = pk.greedy_answerer(net, tok, 6)
    for t in pk.trials([64, 96], settings.depth_list, 2, settings.seed, len(paragraphs)):
        prompt = pk.build_prompt(tok, paragraphs, t.length, t.depth, t.key, t.start_paragraph)
        key = torch.tensor(key_tokens(tok, t.key))
        with torch.no_grad():
            logits = net(torch.cat((prompt.ids, key))[None]).logits[0]  # [L + k, V]
        k = key.numel()
        nlls.append(F.cross_entropy(logits[-k - 1 : -1], key).item())
        hit = bool((logits[-k - 1 : -1].argmax(-1) == key).all())
        exact += hit
        if hit:
            assert answer(prompt.ids).strip().startswith(t.key)
    assert abs(result["nll"] - sum(nlls) / len(nlls)) < 1e-5
    assert result["exact"] == exact


@pytest.mark.filterwarnings("ignore:latent 16")
def test_lossless_stage_probe_equals_the_source(tmp_path):
    """The stage hook probes the source and every stage; a lossless conversion's stages score as the
    source does (the probe sees the exactness ladder)."""
    from transformers import AutoConfig

    from transmla.convert.options import ConvertOptions
    from transmla.convert.pipeline import LayerStream
    from transmla.convert.registry import get_method
    from transmla.eval.stages import stage_report

    src = tmp_path / "src"
    make_tiny_model("llama", src, vocab_size=len(VOCAB))
    word_tokenizer(src)
    filler = filler_file(tmp_path / "f.txt")
    probes: dict = {}
    hook = stage_report(str(filler), progress=False, passkey=_settings(filler), passkey_lengths=[64], probes=probes)
    # TransMLA at full rank (rope 16 + latent 32 = the source's 2 x 2 x 8 key and value dims) is exact.
    config = AutoConfig.from_pretrained(src)
    opts = ConvertOptions.of(method="transmla", kv_lora_rank=16, rope_dim=16, fit_steps=0, freqfold=1, shared_rope=False)
    calib = torch.randint(0, len(VOCAB), (4, 32), generator=torch.Generator().manual_seed(1))
    stream = LayerStream(get_method("transmla"), src, config, opts, progress=False, calib_ids=calib, keep_stages=True)
    for _ in stream:
        pass
    hook(src, config, stream.stages)
    assert set(probes) >= {"source", "bkv_pca"}
    for name, r in probes.items():
        assert abs(r["nll"] - probes["source"]["nll"]) < 1e-4 * max(1.0, probes["source"]["nll"]), (name, r["nll"])
        assert r["exact"] == probes["source"]["exact"]
