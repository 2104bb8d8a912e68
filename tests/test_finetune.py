"""Fine-tuning: recipes, packing without cross-document attention, the loop, resume, outputs."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import yaml

from conftest import make_tiny_model
from transmla.finetune.data import (
    IGNORE,
    PAD_SEGMENT,
    StepSampler,
    load_documents,
    pack_documents,
    segment_mask,
    split_documents,
)
from transmla.finetune.recipe import apply_overrides, load_recipe, parse_recipe
from transmla.finetune.train import TRAINABLE_PATTERNS, lr_factor, run_finetune

REPO = Path(__file__).resolve().parent.parent
VOCAB = 96


def _doc(rng: random.Random) -> str:
    x, words = rng.randrange(VOCAB), []
    for _ in range(rng.randrange(20, 120)):
        words.append(f"w{x}")
        x = (x * 7 + 3) % VOCAB  # a learnable next-token rule
    return " ".join(words)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny lossless-converted MLA model with a word-level tokenizer, and train/eval texts."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from transmla.convert.api import convert
    from transmla.convert.options import ConvertOptions

    root = tmp_path_factory.mktemp("ft")
    src = root / "src"
    make_tiny_model("llama", src)
    vocab = {f"w{i}": i for i in range(VOCAB)} | {"[UNK]": VOCAB}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[UNK]").save_pretrained(src)
    convert(str(src), root / "mla", ConvertOptions.of(method="lossless"), progress=False)
    rng = random.Random(0)
    (root / "train.txt").write_text("\n\n".join(_doc(rng) for _ in range(120)))
    (root / "eval.txt").write_text("\n\n".join(_doc(rng) for _ in range(30)))
    return root


def _recipe(tiny: Path, out: Path, **sections) -> dict:
    data = {
        "model": {"path": str(tiny / "mla")},
        "data": {"train": str(tiny / "train.txt"), "seq_len": 32},
        "train": {"steps": 6, "trainable": "mla", "micro_batch_size": 2, "grad_accum": 2, "device": "cpu", "threads": 1},
        "optimizer": {"lr": 3e-3},
        "schedule": {"kind": "cosine", "warmup_steps": 2},
        "eval": {"data": str(tiny / "eval.txt"), "seq_len": 32, "windows": 2, "final_windows": 4},
        "output_dir": str(out),
    }
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return data


# --- recipes -----------------------------------------------------------------------------------


def test_recipe_good_and_overrides(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"source": "smollm2-135m", "convert": {"method": "transmla", "kv_budget": 0.25, "freqfold": "auto"}},
        "train": {"steps": 10},
        "output_dir": "out/a",
    }))
    r = load_recipe(path)
    assert r.train.trainable == "mla" and r.data.train == "wiki" and r.output_dir == Path("out/a")
    r = load_recipe(path, [
        "output_dir=out/b", "train.steps=7", "model.convert.kv_budget=0.5", "optimizer.betas=[0.8, 0.9]",
        "optimizer.lr=2e-4", "data.packing=false", "model.convert.freqfold=2",
    ])
    assert r.output_dir == Path("out/b") and r.train.steps == 7 and r.model.convert.kv_budget == 0.5
    assert r.optimizer.betas == (0.8, 0.9) and r.optimizer.lr == 2e-4 and r.data.packing is False
    assert r.model.convert.freqfold == "2"
    # a token budget becomes whole steps
    r = load_recipe(path, ["train.steps=null", "train.tokens=1000", "data.seq_len=64", "train.micro_batch_size=2"])
    assert r.total_steps() == 8 and r.total_steps(world_size=2) == 4
    # a nested section that the file does not have is created by the override
    assert apply_overrides({}, ["a.b.c=1"]) == {"a": {"b": {"c": 1}}}


@pytest.mark.parametrize(
    "change, expect",
    [
        ({"trian": {"steps": 3}}, "unknown key 'trian'"),
        ({"train": {"steps": 3, "lr": 1.0}}, "unknown key 'train.lr'"),
        ({"model": {"source": "x", "convert": {"kvbudget": 0.5}}}, "unknown key 'model.convert.kvbudget'"),
        ({"train": {"steps": "many"}}, "train.steps: Input should be a valid integer"),
        ({"data": {"seq_len": 1}}, "data.seq_len: Input should be greater than or equal to 2"),
        ({"train": {"steps": 3, "trainable": "mlp"}}, "train.trainable: Input should be 'all', 'attention' or 'mla'"),
        ({"train": {"steps": 3, "tokens": 100}}, "exactly one of train.steps or train.tokens"),
        ({"model": {"path": "a", "source": "b"}}, "exactly one of model.path"),
        ({"output_dir": None}, "output_dir"),
        ({"train": {"steps": 3, "objective": "kl"}}, "train.objective: Input should be 'lm' or 'distill'"),
        ({"train": {"steps": 3, "objective": "distill"}}, "r.yaml: distill.teacher: required with model.path"),
        ({"train": {"steps": 3, "objective": "distill"}, "distill": {"teacher": "src", "temperature": 0}},
         "distill.temperature: Input should be greater than 0"),
        ({"train": {"steps": 3, "objective": "distill"}, "distill": {"teacher": "src", "alpha": 1.5}},
         "distill.alpha: Input should be less than or equal to 1"),
        ({"distill": {"teacher": "src"}}, "distill: its settings apply only with train.objective: distill"),
        ({"distill": {"teachr": "src"}}, "unknown key 'distill.teachr'"),
        ({"data": {"repeated_spans": 2}}, "data.repeated_spans needs data.documents: none"),
        ({"data": {"answer_weight": 4}}, "data.answer_weight 4 needs data.stated_facts (the answers it weights)"),
        ({"data": {"answer_weight": 0.5}}, "data.answer_weight: Input should be greater than or equal to 1"),
        ({"data": {"stated_facts": 1}}, "data.stated_facts needs data.documents: none"),
        ({"data": {"repeated_spans": 1, "documents": "none", "seq_len": 64}},
         "data.repeated_spans needs data.seq_len of at least 65 (got 64)"),
    ],
)
def test_recipe_errors(change, expect):
    data = {"model": {"path": "some/mla"}, "train": {"steps": 3}, "output_dir": "out"}
    data.update(change)
    with pytest.raises(ValueError) as e:
        parse_recipe(data, "r.yaml")
    assert expect in str(e.value) and "\n" not in str(e.value)


def test_recipe_distill_teacher():
    source = {"source": "smollm2-135m", "convert": {"method": "transmla", "kv_budget": 0.25}}
    r = parse_recipe({"model": source, "train": {"steps": 3, "objective": "distill"}, "output_dir": "o"})
    assert r.teacher() == "smollm2-135m" and r.distill.temperature == 1.0 and r.distill.alpha == 1.0
    r = parse_recipe({"model": {"path": "m"}, "train": {"steps": 3, "objective": "distill"},
                      "distill": {"teacher": "src", "temperature": 2.0, "alpha": 0.5}, "output_dir": "o"})
    assert r.teacher() == "src" and parse_recipe(r.dump()) == r
    assert parse_recipe({"model": {"path": "m"}, "train": {"steps": 3}, "output_dir": "o"}).teacher() is None


def test_recipe_override_and_file_errors(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("model: {path: m}\ntrain: {steps: 3}\noutput_dir: o\n")
    with pytest.raises(ValueError, match="key=value"):
        load_recipe(path, ["train.steps"])
    with pytest.raises(ValueError, match="unknown key 'train.step'"):
        load_recipe(path, ["train.step=4"])
    with pytest.raises(ValueError, match="train.steps is not a section"):
        load_recipe(path, ["train.steps.x=4"])
    with pytest.raises(FileNotFoundError):
        load_recipe(tmp_path / "missing.yaml")
    path.write_text("model: [unclosed\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_recipe(path)


def test_shipped_recipes_validate():
    recipes = sorted((REPO / "recipes").glob("*.yaml"))
    assert len(recipes) >= 3
    for path in recipes:
        first = path.read_text().splitlines()[0]
        assert first.startswith("# ") and f"transmla finetune recipes/{path.name}" in first, path.name
        load_recipe(path)


# --- data --------------------------------------------------------------------------------------


def test_split_documents():
    wiki = " = A = \n\nalpha one.\n\nalpha two.\n\n = B = \n\n = = Section = = \n\nbeta."
    docs = split_documents(wiki)
    assert len(docs) == 2 and docs[0].startswith(" = A = ") and "= = Section = =" in docs[1]
    assert split_documents("one\n\ntwo\n \nthree") == ["one", "two", "three"]
    assert split_documents("one\n\ntwo", "none") == ["one\n\ntwo"]


def test_jsonl_rows_are_documents(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a b"}\n{"text": "c\\n\\nd"}\n\n{"text": "e"}\n')
    assert load_documents(str(path)) == ["a b", "c\n\nd", "e"]


def test_packing_segments_positions_labels():
    docs = [torch.arange(10, 15), torch.arange(20, 23), torch.arange(30, 40)]
    p = pack_documents(docs, seq_len=6)
    assert p.input_ids.shape == (3, 6) and p.tokens == 18  # 18 tokens, no tail
    assert p.input_ids[0].tolist() == [10, 11, 12, 13, 14, 20]
    assert p.position_ids[0].tolist() == [0, 1, 2, 3, 4, 0]
    assert p.labels[0].tolist() == [11, 12, 13, 14, IGNORE, IGNORE]  # none across a boundary or the end
    assert p.position_ids[1].tolist() == [0, 1, 0, 1, 2, 3]  # doc 1 continues (a new piece), then doc 2
    assert p.labels[1].tolist() == [22, IGNORE, 31, 32, 33, IGNORE]  # last position: no next token here
    mask = segment_mask(p.segment_ids[:1])[0, 0]
    assert mask[5].tolist() == [False] * 5 + [True] and mask[4].tolist() == [True] * 5 + [False]
    q = pack_documents(docs, seq_len=6, packing=False, pad_id=0)
    assert q.input_ids.shape == (4, 6)  # 5 -> 1 row, 3 -> 1 row, 10 -> 2 rows
    assert q.input_ids[1].tolist() == [20, 21, 22, 0, 0, 0]
    assert q.segment_ids[1].tolist() == [1, 1, 1, PAD_SEGMENT, PAD_SEGMENT, PAD_SEGMENT]
    assert q.labels[1].tolist() == [21, 22] + [IGNORE] * 4 and q.tokens == 18


def test_repeated_spans_copy_within_each_training_sequence(tiny):
    """data.repeated_spans: each sequence holds its span copies (the fit's with_repeated_span, the
    recipe's seed), labels are the next token of the changed text, the recipe's seed decides them."""
    from transformers import AutoTokenizer

    from transmla.data.calib import with_repeated_span
    from transmla.finetune.train import _training_data

    tok = AutoTokenizer.from_pretrained(tiny / "mla")
    plain = _training_data(parse_recipe(_recipe(tiny, tiny / "o", data={"documents": "none", "seq_len": 300}), "r"), tok)
    spans = _training_data(parse_recipe(_recipe(tiny, tiny / "o", data={"documents": "none", "seq_len": 300,
                                                                        "repeated_spans": 2}), "r"), tok)
    assert torch.equal(spans.input_ids, with_repeated_span(plain.input_ids, 0, spans=2))
    assert not torch.equal(spans.input_ids, plain.input_ids)
    assert torch.equal(spans.labels[:, :-1], spans.input_ids[:, 1:])  # one segment per sequence
    assert torch.equal(spans.position_ids, plain.position_ids)
    other = _training_data(parse_recipe(_recipe(tiny, tiny / "o", data={"documents": "none", "seq_len": 300,
                                                                        "repeated_spans": 2},
                                                train={"seed": 1}), "r"), tok)
    assert not torch.equal(other.input_ids, spans.input_ids)


def test_packing_never_attends_across_documents(tiny):
    """A packed sequence computes exactly what each document computes alone."""
    from transformers import AutoModelForCausalLM

    import transmla  # noqa: F401

    model = AutoModelForCausalLM.from_pretrained(tiny / "mla", dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, VOCAB, (11,), generator=g), torch.randint(0, VOCAB, (13,), generator=g)
    packed = pack_documents([a, b], seq_len=24)
    batch = packed.batch(torch.tensor([0]))
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                       attention_mask=batch["attention_mask"], use_cache=False).logits[0]
        alone_a = model(input_ids=a[None]).logits[0]
        alone_b = model(input_ids=b[None]).logits[0]
        # a different first document changes nothing in the second one
        other = pack_documents([torch.randint(0, VOCAB, (11,), generator=g), b], seq_len=24).batch(torch.tensor([0]))
        logits_other = model(input_ids=other["input_ids"], position_ids=other["position_ids"],
                             attention_mask=other["attention_mask"], use_cache=False).logits[0]
    torch.testing.assert_close(logits[:11], alone_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[11:], alone_b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits_other[11:], logits[11:], atol=1e-6, rtol=1e-6)
    # plain causal attention over the same tokens lets the second document see the first
    with torch.no_grad():
        leaky = model(input_ids=batch["input_ids"], use_cache=False).logits[0]
    assert (leaky[11:] - alone_b).abs().max() > 1e-3


def test_step_sampler_is_a_function_of_step():
    s = StepSampler(10, per_step=4, seed=3)
    seen = torch.cat([s.indices(i) for i in range(5)])  # 20 = two epochs
    assert sorted(seen[:10].tolist()) == list(range(10)) and sorted(seen[10:].tolist()) == list(range(10))
    assert torch.equal(StepSampler(10, 4, seed=3).indices(3), s.indices(3))


def test_lr_schedules():
    assert lr_factor("constant", 0, 10, 2, 0.0) == 0.5 and lr_factor("constant", 9, 10, 2, 0.0) == 1.0
    assert lr_factor("cosine", 2, 10, 2, 0.1) == pytest.approx(1.0)
    assert lr_factor("cosine", 10, 10, 2, 0.1) == pytest.approx(0.1)
    assert lr_factor("linear", 6, 10, 2, 0.0) == pytest.approx(0.5)


# --- the loop ----------------------------------------------------------------------------------


def test_steps_reduce_loss_and_output_reloads(tiny, tmp_path):
    """Training lowers the held-out loss; the saved model reloads and evaluates identically."""
    from transformers import AutoModelForCausalLM

    import transmla  # noqa: F401
    from transmla.data.texts import load_text
    from transmla.eval.perplexity import perplexity, tokenize_text
    from transformers import AutoTokenizer

    out = tmp_path / "run"
    recipe = parse_recipe(_recipe(
        tiny, out, train={"steps": 12, "trainable": "all"}, optimizer={"lr": 1e-2}, eval={"every": 6}, checkpoint={"every": 0}
    ))
    result = run_finetune(recipe, progress=False)
    assert result.completed and result.steps == 12 and result.tokens == 12 * 4 * 32
    assert result.final_perplexity < 0.7 * result.start_perplexity
    for name in ("train_log.csv", "eval_log.csv", "metrics.json", "curves.png", "recipe.yaml"):
        assert (out / name).is_file(), name
    metrics = json.loads((out / "metrics.json").read_text())
    assert len(metrics["train_log"]) == 12 and metrics["summary"]["final_perplexity"] == result.final_perplexity
    assert [r["tag"] for r in metrics["eval_log"]] == ["start", "start", "train", "final", "final"]

    model = AutoModelForCausalLM.from_pretrained(out / "model")
    tok = AutoTokenizer.from_pretrained(out / "model")
    assert model.config.mla["method"]["finetune"]["steps"] == 12
    ids = tokenize_text(tok, load_text(str(tiny / "eval.txt")))
    again = perplexity(model, ids, seq_len=32, max_windows=4, progress=False)
    assert again.tokens == result.eval_tokens
    assert again.perplexity == pytest.approx(result.final_perplexity, rel=1e-6)


def test_resume_continues_identically(tiny, tmp_path):
    common = dict(train={"steps": 6}, eval={"data": None}, checkpoint={"every": 3})
    run_finetune(parse_recipe(_recipe(tiny, tmp_path / "full", **common)), progress=False)
    part = parse_recipe(_recipe(tiny, tmp_path / "part", **common))
    first = run_finetune(part, stop_after=3, progress=False)
    assert not first.completed and first.steps == 3 and first.model_dir is None
    assert (tmp_path / "part" / "checkpoints" / "step-000003" / "trainer.json").is_file()
    second = run_finetune(part, progress=False)
    assert second.completed and second.resumed_from.endswith("step-000003")
    losses = lambda d: [r["loss"] for r in json.loads((d / "metrics.json").read_text())["train_log"]]  # noqa: E731
    assert losses(tmp_path / "part") == losses(tmp_path / "full")  # the same numbers, bit for bit
    from safetensors.torch import load_file

    a, b = load_file(tmp_path / "full" / "model" / "model.safetensors"), load_file(tmp_path / "part" / "model" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_refuses_a_run_from_another_start(tiny, tmp_path):
    """A checkpoint remembers the model its run started from (its config.json's sha256); after that
    model changed (converted again, replaced) a resume would train the new start from stale weights."""
    import shutil

    start = tmp_path / "start"
    shutil.copytree(tiny / "mla", start)
    recipe = parse_recipe(_recipe(tiny, tmp_path / "run", model={"path": str(start)}, train={"steps": 4},
                                  eval={"data": None}, checkpoint={"every": 2}))
    assert not run_finetune(recipe, stop_after=2, progress=False).completed
    config = json.loads((start / "config.json").read_text())
    (start / "config.json").write_text(json.dumps(config | {"note": "converted again"}))
    with pytest.raises(ValueError, match="continues a run that started from another model"):
        run_finetune(recipe, progress=False)
    (start / "config.json").write_text(json.dumps(config))  # byte for byte other than the first: still refused
    with pytest.raises(ValueError, match="started from another model"):
        run_finetune(recipe, progress=False)
    fresh = parse_recipe(recipe.dump() | {"checkpoint": {"every": 2, "resume": "never"}})
    assert run_finetune(fresh, progress=False).completed


def test_new_conversion_refuses_stale_checkpoints(tiny, tmp_path):
    """model.convert changed (or its defaults did): the checkpoints of the previous conversion's run
    are refused before anything is converted."""
    model = {"source": str(tiny / "src"), "convert": {"method": "lossless"}}
    first = parse_recipe(_recipe(tiny, tmp_path / "conv", train={"steps": 4}, eval={"data": None},
                                 checkpoint={"every": 2}) | {"model": model})
    assert not run_finetune(first, stop_after=2, progress=False).completed
    stamp = (tmp_path / "conv" / "converted" / "config.json").stat().st_mtime_ns
    changed = parse_recipe(first.dump() | {"model": {**model, "convert": {"method": "lossless", "dtype": "bf16"}}})
    with pytest.raises(ValueError, match="earlier conversion"):
        run_finetune(changed, progress=False)
    assert (tmp_path / "conv" / "converted" / "config.json").stat().st_mtime_ns == stamp  # nothing converted


@pytest.mark.parametrize("trainable", ["mla", "attention"])
def test_frozen_parameters_unchanged(tiny, tmp_path, trainable):
    import re

    from safetensors.torch import load_file

    out = tmp_path / trainable
    run_finetune(parse_recipe(_recipe(tiny, out, train={"steps": 3, "trainable": trainable}, eval={"data": None})), progress=False)
    before, after = load_file(tiny / "mla" / "model.safetensors"), load_file(out / "model" / "model.safetensors")
    pattern = re.compile(TRAINABLE_PATTERNS[trainable])
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(pattern.search(k) for k in changed), changed
    trained = {k for k in before if pattern.search(k)}
    assert trained == changed  # every selected weight moved, nothing else did
    if trainable == "mla":
        assert not any(".o_proj." in k for k in changed)


def test_bf16_and_checkpointing_options_run(tiny, tmp_path):
    recipe = parse_recipe(_recipe(
        tiny, tmp_path / "bf16",
        train={"steps": 2, "precision": "bf16", "gradient_checkpointing": True, "recompute_kv": True, "trainable": "all"},
        eval={"data": None}, data={"packing": False},
    ))
    result = run_finetune(recipe, progress=False)
    assert result.completed and result.final_loss is not None and torch.isfinite(torch.tensor(result.final_loss))
    cfg = json.loads((tmp_path / "bf16" / "model" / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16"


def test_source_is_converted_first_and_reused(tiny, tmp_path):
    recipe = parse_recipe(_recipe(
        tiny, tmp_path / "conv", model={"source": str(tiny / "src"), "convert": {"method": "lossless"}},
        train={"steps": 1}, eval={"data": None},
    ) | {"model": {"source": str(tiny / "src"), "convert": {"method": "lossless"}}})
    first = run_finetune(recipe, progress=False)
    assert first.converted_dir == str(tmp_path / "conv" / "converted")
    stamp = (tmp_path / "conv" / "converted" / "config.json").stat().st_mtime_ns
    recipe2 = parse_recipe(recipe.dump() | {"checkpoint": {"resume": "never"}})
    run_finetune(recipe2, progress=False)
    assert (tmp_path / "conv" / "converted" / "config.json").stat().st_mtime_ns == stamp  # reused


# --- recompute ---------------------------------------------------------------------------------


def test_kv_recompute_same_gradients_less_saved_memory(tiny):
    from transformers import AutoModelForCausalLM

    import transmla  # noqa: F401
    from transmla.mla.recompute import disable_kv_recompute, enable_kv_recompute

    model = AutoModelForCausalLM.from_pretrained(tiny / "mla", dtype=torch.float32).train()
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))

    def run():
        saved = []

        def pack(t):
            saved.append(t.numel() * t.element_size())
            return t

        model.zero_grad(set_to_none=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, sum(saved)

    loss0, grads0, bytes0 = run()
    assert enable_kv_recompute(model) == 2
    loss1, grads1, bytes1 = run()
    disable_kv_recompute(model)
    assert torch.equal(loss0, loss1)
    for name in grads0:
        torch.testing.assert_close(grads1[name], grads0[name], atol=1e-6, rtol=1e-5)
    assert bytes1 < bytes0


# --- command line ------------------------------------------------------------------------------


def test_cli_finetune_and_errors(tiny, tmp_path, capsys):
    from transmla.cli.app import main

    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(_recipe(tiny, tmp_path / "cli", train={"steps": 2}, eval={"data": None})))
    assert main(["finetune", str(path), "--set", f"output_dir={tmp_path / 'cli2'}", "--set", "train.steps=1", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["steps"] == 1 and payload["output_dir"] == str(tmp_path / "cli2")
    assert (tmp_path / "cli2" / "model" / "config.json").is_file()
    assert main(["finetune", str(path), "--set", "train.stepz=1"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == "error: r.yaml: unknown key 'train.stepz'"


# --- distillation ------------------------------------------------------------------------------


def _distill(tiny: Path, out: Path, **sections) -> dict:
    """A distillation recipe: the lossless conversion learns from its own source."""
    data = _recipe(tiny, out, **sections)
    data["train"] = {**data["train"], "objective": "distill"}
    data.setdefault("distill", {"teacher": str(tiny / "src")})
    return data


def _logged(out: Path, key: str) -> list[float]:
    return [r[key] for r in json.loads((out / "metrics.json").read_text())["train_log"]]


def test_distill_kl_matches_kl_div():
    """The training KL is torch's kl_div(log p_s, log p_t) per token, times T^2 in the objective,
    over the scored tokens only (padding and document ends carry huge logits here: ignored)."""
    import torch.nn.functional as F

    from transmla.finetune.distill import distill_objective, scored_kl_sum
    from transmla.finetune.recipe import DistillSpec

    g = torch.Generator().manual_seed(0)
    student = 3 * torch.randn(3, 9, VOCAB + 1, generator=g)  # [B, T, V]
    teacher = 3 * torch.randn(3, 9, VOCAB + 1, generator=g)  # [B, T, V]
    labels = torch.randint(0, VOCAB, (3, 9), generator=g)  # [B, T]
    labels[0, 6:] = IGNORE  # padding
    labels[1, 4] = IGNORE  # a document boundary
    scored = labels != IGNORE
    student[~scored], teacher[~scored] = 1e4, -1e4
    for temperature in (1.0, 2.5):
        per_token = F.kl_div(F.log_softmax(student / temperature, -1), F.log_softmax(teacher / temperature, -1),
                             reduction="none", log_target=True).sum(-1)  # [B, T]
        want = per_token[scored].mean()
        got = scored_kl_sum(student, teacher, labels, temperature) / scored.sum()
        assert abs(float(got) - float(want)) < 1e-6 and float(want) > 0.1
        spec = DistillSpec(temperature=temperature, alpha=0.25)
        assert distill_objective(got, 3.0, spec) == pytest.approx(0.25 * temperature**2 * float(got) + 0.75 * 3.0)


def test_distill_from_itself_is_zero(tiny, tmp_path):
    """A lossless conversion computes its source: the KL at step 0 is zero, over packed sequences
    whose documents the teacher sees through the same block-diagonal mask."""
    out = tmp_path / "self"
    run_finetune(parse_recipe(_distill(tiny, out, train={"steps": 1}, eval={"data": None})), progress=False)
    row = json.loads((out / "metrics.json").read_text())["train_log"][0]
    assert row["kl"] < 1e-5 and row["loss"] == row["kl"] and row["nll"] > 1.0


def test_distill_lowers_kl_of_a_lossy_conversion(tiny, tmp_path):
    """A source converted lossily into output_dir/converted, distilled from that source (the
    default teacher): the KL on a fixed held-out batch falls; only the MLA projections move."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import transmla  # noqa: F401
    from transmla.checkpoint.resolve import load_lm
    from transmla.finetune.data import document_token_ids, load_documents
    from transmla.finetune.distill import scored_kl_sum
    from transmla.finetune.train import _logits

    out = tmp_path / "lossy"
    model = {"source": str(tiny / "src"), "convert": {"method": "mha2mla", "kv_budget": 0.25}}
    data = _recipe(tiny, out, train={"steps": 40, "objective": "distill"}, optimizer={"lr": 3e-3}, eval={"data": None})
    run_finetune(parse_recipe(data | {"model": model}), progress=False)

    docs = document_token_ids(AutoTokenizer.from_pretrained(tiny / "src"), load_documents(str(tiny / "eval.txt")))
    batch = pack_documents(docs, seq_len=32).batch(torch.arange(8))
    teacher = load_lm(tiny / "src")

    def kl(folder: Path) -> float:
        student = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            kl_sum = scored_kl_sum(_logits(student, batch), _logits(teacher, batch), batch["labels"], 1.0)
        return float(kl_sum) / int((batch["labels"] != IGNORE).sum())

    before, after = kl(out / "converted"), kl(out / "model")
    assert after < 0.85 * before, (before, after)  # measured: 0.0021 -> 0.0011 nats per token (20 steps: 0.0018, too near)
    assert _logged(out, "kl")[-1] < _logged(out, "kl")[0]


def test_distill_resume_continues_identically(tiny, tmp_path):
    """Stopped and resumed, a distillation repeats the losses of an uninterrupted one; checkpoints
    hold the student only."""
    from safetensors.torch import load_file

    common = dict(train={"steps": 4}, eval={"data": None}, checkpoint={"every": 2},
                  distill={"teacher": str(tiny / "src"), "alpha": 0.5})
    run_finetune(parse_recipe(_distill(tiny, tmp_path / "full", **common)), progress=False)
    part = parse_recipe(_distill(tiny, tmp_path / "part", **common))
    assert not run_finetune(part, stop_after=2, progress=False).completed
    saved = load_file(tmp_path / "part" / "checkpoints" / "step-000002" / "model.safetensors")
    assert saved.keys() == load_file(tiny / "mla" / "model.safetensors").keys()
    second = run_finetune(part, progress=False)
    assert second.completed and second.resumed_from.endswith("step-000002")
    for key in ("loss", "kl", "nll"):
        assert _logged(tmp_path / "part", key) == _logged(tmp_path / "full", key), key
    kl, nll, loss = (_logged(tmp_path / "full", k) for k in ("kl", "nll", "loss"))
    assert loss == pytest.approx([0.5 * k + 0.5 * n for k, n in zip(kl, nll)], rel=1e-12)


def test_precision_auto_follows_the_device(monkeypatch):
    import transmla.finetune.train as train

    recipe = parse_recipe({"model": {"path": "m"}, "train": {"steps": 1, "precision": "auto", "device": "cpu"},
                           "output_dir": "o"})
    for fast, precision in ((True, "bf16"), (False, "fp32")):
        monkeypatch.setattr(train, "fast_bf16_matmul", lambda device: fast and device == "cpu")
        assert train.resolve_precision(recipe).train.precision == precision
    assert recipe.train.precision == "auto"


def test_distill_bf16_teacher_frozen(tiny, tmp_path, monkeypatch):
    """Under bf16 the teacher is a frozen bf16 model in eval mode on the student's device."""
    import transmla.finetune.train as train

    teachers = []
    load = train.load_teacher
    monkeypatch.setattr(train, "load_teacher", lambda *args: teachers.append(load(*args)) or teachers[-1])
    result = run_finetune(parse_recipe(_distill(
        tiny, tmp_path / "bf16", train={"steps": 2, "precision": "bf16"}, eval={"data": None},
    )), progress=False)
    (teacher,) = teachers
    assert result.completed and torch.isfinite(torch.tensor(_logged(tmp_path / "bf16", "kl"))).all()
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    assert {p.dtype for p in teacher.parameters()} == {torch.bfloat16}


def test_distill_refuses_a_teacher_windowed_below_the_sequences(tiny_factory):
    """A 4-D document mask reaches a teacher's attention as is and its sliding window is then ignored:
    a window shorter than data.seq_len is refused in one line, a longer one is taken."""
    from transmla.finetune.distill import load_teacher

    model, path = tiny_factory("mistral", sliding_window=8)
    vocab = model.config.vocab_size
    with pytest.raises(ValueError, match="sliding window of 8 tokens, shorter than data.seq_len 16"):
        load_teacher(str(path), torch.float32, torch.device("cpu"), vocab, seq_len=16)
    teacher = load_teacher(str(path), torch.float32, torch.device("cpu"), vocab, seq_len=8)
    assert not any(p.requires_grad for p in teacher.parameters())
