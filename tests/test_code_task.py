"""Code completion of held-out stdlib functions (transmla.eval.code_task, `transmla eval --task code`)."""

from __future__ import annotations

import ast
import json
import math
import sys
import textwrap

import pytest
import torch

from conftest import make_tiny_model
from transmla.data.texts import builtin_text, code_calib_files
from transmla.eval import code_task as ct

SMALL = dict(items=6, choices=3, context_tokens=48, body_tokens=40)


def byte_tokenizer(path=None):
    """Byte-level, no merges: any text in 256 tokens, decoded back exactly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=alphabet[0])
    if path is not None:
        fast.save_pretrained(path)
    return fast


def tiny(path=None):
    return make_tiny_model("llama", path, vocab_size=256, max_position_embeddings=512)


def key(items):
    return [(i.function, i.candidates, i.answer) for i in items]


# --- the items --------------------------------------------------------------------------------------


def test_items_are_seeded_and_held_out_from_calibration():
    settings = ct.CodeSettings(**SMALL)
    items = ct.code_items(settings)
    assert len(items) == 6 and key(ct.code_items(settings)) == key(items)
    assert key(ct.code_items(ct.CodeSettings(**SMALL | {"task_seed": 1}))) != key(items)
    root = ct.stdlib_folder()
    calib_files = {str(p.relative_to(root)) for p in code_calib_files()}
    calib_text = builtin_text("code", "calib")
    assert len({i.function.module for i in items}) == 6  # one function per file
    for item in items:
        fn = item.function
        parts = fn.module.split("/")
        assert fn.module not in calib_files and fn.module in ct.held_out_files()
        assert not {"test", "tests", "idle_test", "site-packages"} & set(parts[:-1])
        assert not ct.in_calibration(fn) and fn.header + "\n" + fn.body not in calib_text
    assert not calib_files & set(ct.held_out_files())
    tops = {m.split("/")[0].removesuffix(".py") for m in ct.held_out_files()}
    assert tops <= set(sys.stdlib_module_names) and not tops & ct.SPLIT_OFF


def test_a_file_missing_from_an_install_removes_only_its_own_item(monkeypatch):
    settings = ct.CodeSettings(**SMALL)
    functions = [i.function for i in ct.code_items(settings)]
    files = ct.held_out_files()
    monkeypatch.setattr(ct, "held_out_files", lambda: tuple(m for m in files if m != functions[2].module))
    again = [i.function for i in ct.code_items(settings)]
    assert again[:5] == functions[:2] + functions[3:]


def test_targets_are_the_true_function_bodies():
    """header + body parses back to the very function of the module; the distractors are other bodies at
    the same indentation."""
    for item in ct.code_items(ct.CodeSettings(**SMALL)):
        fn = item.function
        source = (ct.stdlib_folder() / fn.module).read_text(encoding="utf-8")
        original = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                        and min([n.lineno] + [d.lineno for d in n.decorator_list]) == fn.lineno)
        assert original.name == fn.name.rsplit(".", 1)[-1]
        (rebuilt,) = ast.parse(textwrap.dedent(fn.header + "\n" + fn.body)).body
        # the same body, arguments, decorators and docstring (cleaned: dedent moves its raw lines)
        same = lambda node: ast.dump(ast.Module(node.body[1:], [])) + ast.dump(node.args) + str(  # noqa: E731
            [ast.dump(d) for d in node.decorator_list]) + str(ast.get_docstring(node))
        assert same(rebuilt) == same(original) and ast.get_docstring(rebuilt) is not None
        assert source.endswith(fn.body) or (fn.body + "\n") in source
        assert item.candidates[item.answer] == fn.body and len(item.candidates) == 3
        for k, other in enumerate(item.candidates):
            if k != item.answer:
                assert other != fn.body
                assert ct.first_line(other)[: len(ct._indent(fn.first_line))] == ct._indent(fn.first_line)
                ast.parse(textwrap.dedent(other))  # a whole body on its own


def test_prompt_is_module_text_then_the_header_within_budgets():
    tok = byte_tokenizer()
    fn = ct.code_items(ct.CodeSettings(**SMALL))[0].function
    ids = ct.prompt_ids(tok, fn, 48)
    text = tok.decode(ids)
    assert text.endswith(fn.header) and len(ids) == len(fn.header.encode()) + min(48, len(fn.context.encode()))
    assert (fn.context + fn.header).endswith(text)
    assert ct.prompt_ids(tok, fn, 0) == tok(fn.header, add_special_tokens=False)["input_ids"]
    assert len(ct.prompt_ids(tok, fn, 48, limit=20)) == 20


def test_first_line_and_reindent():
    assert ct.first_line("\n   \n    x = 1\n    y") == "    x = 1"
    assert ct.first_line("  \n") == ""
    assert ct.reindent("  a\n\n    b", "        c") == "        a\n\n          b"


# --- scoring ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def code_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("code")
    tiny(root / "src")
    byte_tokenizer(root / "src")
    from transmla.convert.api import convert
    from transmla.convert.options import ConvertOptions

    convert(str(root / "src"), root / "mla", ConvertOptions.of(method="lossless"), progress=False)
    return root


@pytest.mark.parametrize("name, cache_class", [("src", "DynamicCache"), ("mla", "LatentCache")])
def test_exact_match_generates_through_the_cache(code_model, name, cache_class):
    """Scoring runs the prompt once and the body after it through the cache; generation then prefills the
    prompt once and feeds one token a step with a cache that grows (the latent cache for a converted model,
    in both); its text is the argmax of full forwards."""
    from transmla.checkpoint.resolve import load_model

    net, tok = load_model(str(code_model / name))
    settings = ct.CodeSettings(**SMALL | {"choices": 1})
    item = ct.code_items(settings)[0]
    calls, caches = [], set()

    def spy(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))  # transformers 5.24 passes cache=
        calls.append((kwargs["input_ids"].shape[1], None if cache is None else cache.get_seq_length()))
        caches.add(type(cache).__name__)

    handle = net.register_forward_pre_hook(spy, with_kwargs=True)
    try:
        row = ct.score_item(net, tok, item, settings)
    finally:
        handle.remove()
    prompt = ct.prompt_ids(tok, item.function, settings.context_tokens)
    (score_prompt, score_cached), (score_body, score_seen), (prefill, cached), *steps = calls
    assert score_prompt == len(prompt) and not score_cached
    assert score_body == row["body_tokens"] - 1 and score_seen == len(prompt)  # all but the body's last token
    assert prefill == len(prompt) and not cached
    assert steps and all(width == 1 and seen == len(prompt) + i for i, (width, seen) in enumerate(steps))
    assert caches == {cache_class}
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(len(steps) + 1):
            ids = torch.cat([ids, net(ids).logits[:, -1:].argmax(-1)], dim=1)
    assert row["predicted"] == ct.first_line(tok.decode(ids[0, len(prompt) :].tolist())).strip()


def test_exact_match_is_the_first_body_line(code_model, monkeypatch):
    from transmla.checkpoint.resolve import load_model
    from transmla.eval import passkey

    net, tok = load_model(str(code_model / "src"))
    settings = ct.CodeSettings(**SMALL | {"items": 2})
    items = ct.code_items(settings)
    truth = items[0].function.body
    monkeypatch.setattr(passkey, "greedy_answerer", lambda net, tok, n: lambda ids: "\n\n" + truth + "\nmore")
    result = ct.score_code(net, tok, items, settings)
    assert [r["exact"] for r in result["functions"]] == [True, items[1].function.first_line.strip() ==
                                                          items[0].function.first_line.strip()]
    assert result["functions"][0]["predicted"] == items[0].function.first_line.strip()


def test_cli_scores_are_finite_and_the_source_equals_itself(cli, code_model):
    flags = ("--task", "code", "--items", 4, "--choices", 3, "--context-tokens", 32, "--body-tokens", 32)
    code, out, err = cli("eval", code_model / "src", "--compare", code_model / "src", *flags, "--json")
    assert code == 0, err
    result = json.loads(out)
    source, model = result["models"]
    assert result["task"] == "code" and result["settings"]["body_tokens"] == 32
    assert (source["role"], model["role"]) == ("source", "converted")
    for e in (source, model):
        assert e["items"] == 4 and len(e["functions"]) == 4 and 0 < e["tokens"] <= 4 * 32
        assert math.isfinite(e["nll"]) and e["nll"] > 0 and e["perplexity"] == pytest.approx(math.exp(e["nll"]))
        assert 0 <= e["exact_match"] <= 1 and 0 <= e["acc"] <= 1 and e["chance"] == pytest.approx(1 / 3)
    drop = lambda e: {k: v for k, v in e.items() if k not in ("role", "seconds")}  # noqa: E731
    assert drop(source) == drop(model)
    code, out, err = cli("eval", code_model / "src", *flags[:-4], "--choices", 1, "--body-tokens", 32)
    assert code == 0, err
    assert "exact" in out and "acc_norm" not in out


@pytest.mark.parametrize("flags, message", [
    (("--task", "code", "--body-tokens", "0"), "--body-tokens must be at least 1"),
    (("--task", "code", "--choices", "17"), "--choices must be between 1 and 16"),
    (("--task", "code", "--items", "0"), "--items must be at least 1"),
    (("--task", "code", "--context-tokens", "-1"), "--context-tokens must be 0 or more"),
    (("--body-tokens", "8"), "--body-tokens applies to --task code only"),
    (("--task", "cloze", "--body-tokens", "8"), "--body-tokens applies to --task code only"),
    (("--task", "code", "--depths", "50"), "--depths applies to --task passkey only"),
])
def test_cli_bad_settings_are_one_line(cli, code_model, flags, message):
    code, out, err = cli("eval", code_model / "src", *flags)
    lines = err.strip().splitlines()
    assert code == 1 and out == "" and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err


def test_sweep_scores_code_beside_perplexity(cli, code_model, tmp_path):
    """sweep --tasks code: the exact match of every model, equal to `transmla eval --task code` on the kept
    model; the flags that apply to no asked task are refused."""
    text = tmp_path / "code.txt"
    text.write_text((ct.stdlib_folder() / ct.held_out_files()[0]).read_text(encoding="utf-8")[:6000])
    common = ("--method", "transmla", "--budgets", "0.5", "--data", text, "--seq-len", 32, "--max-windows", 2,
              "--calib", text, "--calib-samples", 4, "--calib-seq-len", 16, "--fit-steps", 0)
    task_flags = ("--items", 2, "--choices", 1, "--context-tokens", 16, "--body-tokens", 16)
    code, stdout, err = cli("sweep", code_model / "src", "--out", tmp_path / "sweep", *common, "--tasks", "code",
                            *task_flags, "--keep", "--json")
    assert code == 0, err
    result = json.loads(stdout)
    row = result["rows"][0]
    assert result["task_scores"] == {"code": "exact_match"} and result["code_settings"]["items"] == 2
    assert "task_settings" not in result and set(result["source"]["tasks"]) == set(row["tasks"]) == {"code"}
    code, again, err = cli("eval", row["model_dir"], "--task", "code", *task_flags, "--json")
    assert code == 0, err
    assert json.loads(again)["models"][0]["exact_match"] == row["tasks"]["code"]
    assert "| code exact_match |" in (tmp_path / "sweep" / "sweep.md").read_text()
    for flags, message in ((("--tasks", "cloze", "--body-tokens", 8), "--body-tokens applies to --tasks code only"),
                           (("--tasks", "code", "--texts", text), "--texts applies to --tasks cloze or recall only"),
                           (("--body-tokens", 8), "--body-tokens needs --tasks")):
        code, _, err = cli("sweep", code_model / "src", "--out", tmp_path / "bad", *common, *flags)
        assert code == 1 and message in err, err
