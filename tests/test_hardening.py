"""Hardening (issue 14): nothing runs from files we load, no non-finite model, nothing left behind
after signals, meaningful exit codes, no writes outside the output folder, our warnings visible."""

from __future__ import annotations

import json
import pickle
import random
from pathlib import Path

import pytest
import yaml

from conftest import make_tiny_model, save_word_tokenizer


class _Planted:
    """Unpickling this creates a file: proof that a loaded pickle ran code."""

    def __init__(self, sentinel: Path):
        self.sentinel = sentinel

    def __reduce__(self):
        return (open, (str(self.sentinel), "w"))


def _plant_pickles(folder: Path, sentinel: Path) -> None:
    payload = pickle.dumps(_Planted(sentinel))
    for name in ("custom_checkpoint_0.pkl", "random_states_0.pkl", "optimizer.bin", "scheduler.bin", "pytorch_model.bin"):
        (folder / name).write_bytes(payload)


@pytest.fixture(scope="module")
def mla(tmp_path_factory):
    """A tiny lossless MLA model with a tokenizer, and a training text."""
    from transmla.convert.api import convert
    from transmla.convert.options import ConvertOptions

    root = tmp_path_factory.mktemp("hard")
    make_tiny_model("llama", root / "src")
    save_word_tokenizer(root / "src")
    convert(str(root / "src"), root / "mla", ConvertOptions.of(method="lossless"), progress=False)
    rng = random.Random(0)
    (root / "train.txt").write_text("\n\n".join(" ".join(f"w{rng.randrange(96)}" for _ in range(80)) for _ in range(40)))
    return root


def _recipe(root: Path, out: Path, **extra) -> dict:
    data = {
        "model": {"path": str(root / "mla")},
        "data": {"train": str(root / "train.txt"), "seq_len": 16},
        "train": {"steps": 4, "trainable": "mla", "micro_batch_size": 2, "device": "cpu", "threads": 1},
        "eval": {"data": None},
        "checkpoint": {"every": 2},
        "output_dir": str(out),
    }
    return data | extra


# --- 1. no code runs from a file we load ------------------------------------------------------


@pytest.mark.parametrize("how", ["auto", "explicit"])
def test_planted_pickle_in_checkpoint_never_runs(mla, tmp_path, how):
    from transmla.finetune.recipe import parse_recipe
    from transmla.finetune.train import run_finetune

    out = tmp_path / "run"
    first = run_finetune(parse_recipe(_recipe(mla, out)), stop_after=2, progress=False)
    assert first.steps == 2 and not first.completed
    step = out / "checkpoints" / "step-000002"
    sentinel = tmp_path / "pwned"
    _plant_pickles(step, sentinel)
    resume = {"checkpoint": {"every": 2, "resume": "auto" if how == "auto" else str(step)}}
    second = run_finetune(parse_recipe(_recipe(mla, out, **resume)), progress=False)
    assert second.completed and second.resumed_from == str(step) and second.steps == 4
    assert not sentinel.exists()


def test_checkpoint_holds_no_pickle(mla, tmp_path):
    from transmla.finetune.recipe import parse_recipe
    from transmla.finetune.train import run_finetune

    run_finetune(parse_recipe(_recipe(mla, tmp_path / "run")), stop_after=2, progress=False)
    files = sorted(p.name for p in (tmp_path / "run" / "checkpoints" / "step-000002").iterdir())
    assert all(name.endswith((".safetensors", ".json")) for name in files), files


# --- 2. no non-finite model written, no NaN reported as a result -------------------------------


def _poisoned(tmp_path: Path, name: str, value: float, where=(0, 0)) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    src = tmp_path / "poisoned"
    make_tiny_model("llama", src)
    save_word_tokenizer(src)
    tensors = load_file(src / "model.safetensors")
    t = tensors[name]
    t[where if t.ndim == 2 else where[0]] = value if value == value else torch.nan
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    return src


@pytest.mark.parametrize("method", ["lossless", "transmla"])
@pytest.mark.parametrize("name", ["model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight"])
def test_non_finite_source_refused_by_name_nothing_written(cli, tmp_path, method, name):
    src = _poisoned(tmp_path, name, float("nan"))
    out = tmp_path / "out"
    args = ["--calib-samples", "4", "--calib-seq-len", "8", "--kv-budget", "0.5"] if method == "transmla" else []
    code, stdout, err = cli("convert", src, out, "--method", method, *args)
    assert code == 1 and stdout == ""
    assert name in err and "non-finite" in err, err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["poisoned"]


def test_non_finite_calibration_statistics_fail(cli, tmp_path):
    src = _poisoned(tmp_path, "model.layers.1.input_layernorm.weight", 3e38)  # finite, but overflows on the way
    code, _, err = cli("convert", src, tmp_path / "out", "--method", "transmla", "--kv-budget", "0.5",
                       "--calib-samples", "4", "--calib-seq-len", "8")
    assert code == 1 and "layer 1's calibration statistics" in err and "non-finite" in err, err
    assert not (tmp_path / "out").exists()


def test_writer_refuses_non_finite_tensor(tmp_path):
    import torch

    from transmla.checkpoint.writer import ShardedWriter

    with pytest.raises(ValueError, match="'b' has 1 non-finite value"):
        with ShardedWriter(tmp_path / "w") as writer:
            writer.add("a", torch.ones(3))
            writer.add("b", torch.tensor([1.0, float("inf")]))
    assert list((tmp_path / "w").iterdir()) == []


def test_eval_fails_on_non_finite_loss(cli, tmp_path):
    src = _poisoned(tmp_path, "model.norm.weight", float("nan"))
    (tmp_path / "t.txt").write_text(" ".join(f"w{i % 50}" for i in range(400)))
    code, stdout, err = cli("eval", src, "--data", tmp_path / "t.txt", "--seq-len", "32", "--json")
    assert code == 1 and stdout == "" and "NaN or Inf" in err, (stdout, err)


def test_truncated_shard_error_names_the_file(cli, tmp_path):
    src = tmp_path / "src"
    make_tiny_model("llama", src)
    shard = src / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    code, _, err = cli("convert", src, tmp_path / "out")
    assert code == 1 and str(shard) in err, err
    shard.write_bytes(b"\x05")
    code, _, err = cli("convert", src, tmp_path / "out")
    assert code == 1 and str(shard) in err, err


@pytest.mark.parametrize("field, value, tensor, fields", [
    ("kv_lora_rank", 12, "kv_a_proj.weight", "mla.kv_lora_rank = 12"),
    ("v_head_dim", 4, "kv_b_proj.weight", "mla.v_head_dim = 4"),
])
def test_config_that_disagrees_with_the_weights_names_tensor_shapes_and_field(mla, cli, tmp_path, field, value, tensor, fields):
    """A converted folder whose config.json was edited by hand: one line with the tensor, both
    shapes and the config fields behind the expected shape (not transformers' "see the report above")."""
    import json
    import shutil

    folder = tmp_path / "edited"
    shutil.copytree(mla / "mla", folder)
    config = json.loads((folder / "config.json").read_text())
    config["mla"][field] = value
    (folder / "config.json").write_text(json.dumps(config))
    code, _, err = cli("eval", folder, "--data", mla / "train.txt", "--seq-len", 16, "--max-windows", 1)
    line = err.strip().splitlines()[-1]
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert f"layers.0.self_attn.{tensor} is [" in line and "from config.json" in line and fields in line, line


# --- 3. nothing left behind after an interruption ----------------------------------------------


@pytest.fixture(scope="module")
def slow_source(tmp_path_factory):
    """A source whose TransMLA conversion takes seconds (calibration), to signal mid-way."""
    src = tmp_path_factory.mktemp("slow") / "src"
    make_tiny_model("llama", src, num_hidden_layers=6, hidden_size=256, intermediate_size=512, vocab_size=4000,
                    num_attention_heads=8, num_key_value_heads=2, head_dim=32)
    (src.parent / "calib.txt").write_text(" ".join(f"w{i * 7 % 90}" for i in range(140000)))
    save_word_tokenizer(src)
    return src


def _start_convert(src: Path, out: Path):
    import os
    import subprocess
    import sys

    transmla = Path(sys.executable).with_name("transmla")
    cmd = [str(transmla), "convert", str(src), str(out), "--method", "transmla", "--kv-budget", "0.25",
           "--calib", str(src.parent / "calib.txt"), "--calib-samples", "1024", "--calib-seq-len", "64",
           "--max-shard-size", "200KB"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "TERM": "dumb"})


def _wait_for(predicate, proc, timeout=240.0):
    import time

    end = time.time() + timeout
    while time.time() < end:
        if predicate():
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended first: {proc.communicate()}")
        time.sleep(0.02)
    proc.kill()
    raise AssertionError("timed out")


def _temporaries(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT", "SIGHUP"])
def test_signal_mid_conversion_leaves_nothing(slow_source, tmp_path, signame):
    import signal

    out = tmp_path / "out"
    proc = _start_convert(slow_source, out)
    _wait_for(lambda: any(tmp_path.glob(".out.tmp-*/.model-*.part")), proc)  # shards being written
    proc.send_signal(getattr(signal, signame))
    _, err = proc.communicate(timeout=120)
    signum = getattr(signal, signame)
    assert proc.returncode == 128 + signum, err
    assert err.strip().splitlines()[-1] == f"error: interrupted ({signame})", err
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_sigkill_leftovers_removed_by_next_run(slow_source, tmp_path, cli):
    import signal

    out = tmp_path / "out"
    proc = _start_convert(slow_source, out)
    _wait_for(lambda: any(tmp_path.glob(".out.tmp-*/.model-*.part")), proc)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    left = _temporaries(tmp_path)
    assert any(n.startswith(".out.tmp-") and not n.endswith(".lock") for n in left), left  # what SIGKILL leaves
    code, _, err = cli("convert", slow_source, tmp_path / "other", "--method", "lossless")
    assert code == 0, err
    assert "left by an interrupted run" in err
    assert _temporaries(tmp_path) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["other"]


def test_live_runs_temporaries_are_kept_and_old_version_leftovers_removed(tmp_path):
    from transmla.checkpoint.writer import scratch_dir, remove_stale_temporaries

    with scratch_dir(tmp_path, "live") as live:
        (live / "model.safetensors").write_bytes(b"x")
        old_version = tmp_path / ".gone.tmp-abc123"  # no lock file: a run of an older version
        old_version.mkdir()
        (old_version / ".model-00001.safetensors.part").write_bytes(b"x")
        foreign = tmp_path / ".notes.tmp-keep"  # not a conversion's folder
        foreign.mkdir()
        (foreign / "diary.txt").write_text("mine")
        done = remove_stale_temporaries(tmp_path)
        assert live.is_dir() and not old_version.exists() and foreign.is_dir()
        assert done == [f"removed {old_version}, left by an interrupted run"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".notes.tmp-keep"]


def test_killed_force_run_restores_the_previous_output(tmp_path):
    import os

    from transmla.checkpoint.writer import remove_stale_temporaries

    # the state a run killed between its two renames leaves: output moved aside, new one not yet in place
    tmp = tmp_path / ".out.tmp-xyz"
    tmp.mkdir()
    (tmp_path / ".out.tmp-xyz.lock").write_text(str(os.getpid()))
    aside = tmp_path / ".out.tmp-xyz.old"
    aside.mkdir()
    (aside / "config.json").write_text("{}")
    done = remove_stale_temporaries(tmp_path)
    assert (tmp_path / "out" / "config.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], done


# --- 4. exit codes and messages from the CLI layer (the installed console script) --------------


def _console(*args, timeout=300):
    import subprocess
    import sys

    transmla = Path(sys.executable).with_name("transmla")
    return subprocess.run([str(transmla), *map(str, args)], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args, needle", [
    (["convert", "src", "out", "--kv-budget", "abc"], "'--kv-budget'"),
    (["convert", "src"], "Missing argument 'output'"),
    (["nosuch"], "No such command 'nosuch'"),
])
def test_usage_errors_exit_2_naming_the_option(args, needle):
    proc = _console(*args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], proc.stderr
    assert proc.stdout == ""


def test_bare_command_prints_help():
    proc = _console()
    assert proc.returncode == 0 and "Usage: transmla" in proc.stdout and "Commands" in proc.stdout
    assert "error" not in proc.stderr.lower(), proc.stderr


# --- 5. never write outside the output folder, never destroy the source ------------------------


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("layout", ["same", "inside", "around"])
def test_output_may_not_be_or_overlap_the_source(mla, tmp_path, cli, layout):
    import shutil

    src = tmp_path / "models" / "src"
    shutil.copytree(mla / "src", src)
    before = _tree(tmp_path / "models")
    out = {"same": src, "inside": src / "mla", "around": src.parent}[layout]
    code, _, err = cli("convert", src, out, "--force")
    assert code == 1 and "source folder" in err, err
    assert _tree(tmp_path / "models") == before


def test_symlinked_tokenizer_file_leaving_the_source_is_refused(mla, tmp_path, cli):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(mla / "src", src)
    secret = tmp_path / "secret.txt"
    secret.write_text("not a tokenizer")
    (src / "tokenizer_config.json").unlink()
    (src / "tokenizer_config.json").symlink_to(secret)
    code, _, err = cli("convert", src, tmp_path / "out")
    assert code == 1 and "tokenizer_config.json" in err and "outside" in err, err
    assert not (tmp_path / "out").exists()


def test_symlinks_within_the_source_and_hf_cache_layout_are_followed(mla, tmp_path):
    import shutil

    from transmla.checkpoint.files import copy_tokenizer_files

    repo = tmp_path / "models--org--tiny"
    snap = repo / "snapshots" / "abc"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    shutil.copy(mla / "src" / "tokenizer.json", repo / "blobs" / "f00")
    (snap / "tokenizer.json").symlink_to("../../blobs/f00")
    (snap / "tokenizer_config.json").write_text("{}")
    (snap / "special_tokens_map.json").symlink_to("tokenizer_config.json")  # within the folder
    assert copy_tokenizer_files(snap, tmp_path / "out") == ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (mla / "src" / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("link", ["model", "recipe.yaml", "checkpoints"])
def test_finetune_never_writes_through_a_symlink(mla, tmp_path, link):
    from transmla.finetune.recipe import parse_recipe
    from transmla.finetune.train import run_finetune

    out = tmp_path / "run"
    out.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "config.json").write_text("precious")
    (out / link).symlink_to(elsewhere if link != "recipe.yaml" else elsewhere / "config.json")
    with pytest.raises(ValueError, match="symlink"):
        run_finetune(parse_recipe(_recipe(mla, out)), progress=False, force=True)
    assert _tree(elsewhere) == {"config.json": b"precious"}


def test_finetune_output_dir_empty_or_earlier_run_or_force(mla, tmp_path, cli):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(_recipe(mla, out, train={**_recipe(mla, out)["train"], "steps": 2})))
    code, _, err = cli("finetune", recipe)
    assert code == 1 and "not empty" in err and "--force" in err, err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    code, _, err = cli("finetune", recipe, "--force", "--json")
    assert code == 0, err
    assert (out / "notes.txt").read_text() == "mine" and (out / "model" / "config.json").is_file()
    code, _, err = cli("finetune", recipe, "--set", f"output_dir={tmp_path / 'again'}", "--json")
    assert code == 0, err
    code, _, err = cli("finetune", recipe, "--set", f"output_dir={tmp_path / 'again'}", "--json")  # an earlier run: resumes
    assert code == 0, err


# --- 6. the project's own warnings reach the user; meaningless settings are errors ------------


@pytest.mark.parametrize("args, needle", [
    (["--method", "transmla", "--kv-budget", "1.5"], "between 0 and 1"),
    (["--method", "mha2mla", "--kv-budget", "1"], "between 0 and 1"),
    (["--method", "transmla", "--kv-budget", "0"], "between 0 and 1"),
    (["--method", "lossless", "--kv-budget", "0.25"], "--kv-budget does not apply to method lossless"),
    (["--method", "lossless", "--kv-lora-rank", "8"], "--kv-lora-rank does not apply to method lossless"),
    (["--method", "transmla", "--kv-budget", "0.5", "--rotation", "complex"], "rotation must be one of real, unitary or auto"),
])
def test_meaningless_cache_settings_are_errors(mla, tmp_path, cli, args, needle):
    code, _, err = cli("convert", mla / "src", tmp_path / "out", *args)
    assert code == 1 and needle in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("method, shape", [("transmla", ["-R", "28", "-r", "4"]), ("mha2mla", ["-R", "28", "-P", "1"])])
def test_no_shrink_warning_is_shown(mla, tmp_path, cli, method, shape):
    (tmp_path / "t.txt").write_text(" ".join(f"w{i % 50}" for i in range(3000)))
    code, _, err = cli("convert", mla / "src", tmp_path / "out", "--method", method, *shape,
                       "--calib", tmp_path / "t.txt", "--calib-samples", "8", "--calib-seq-len", "16")
    assert code == 0, err
    assert "warning:" in err and "the cache does not shrink" in err, err


# --- 7. the smaller items -----------------------------------------------------------------------


@pytest.mark.parametrize("prompt", ["", "   "])
def test_generate_empty_prompt_is_one_line_error(mla, cli, prompt):
    code, out, err = cli("generate", mla / "mla", prompt, "--max-new-tokens", "2")
    assert code == 1 and out == "" and err.startswith("error: the prompt") and len(err.strip().splitlines()) == 1, err


def test_seq_len_beyond_max_positions_warns(mla, tmp_path, cli):
    (tmp_path / "t.txt").write_text(" ".join(f"w{i % 50}" for i in range(1200)))
    code, _, err = cli("eval", mla / "mla", "--data", tmp_path / "t.txt", "--seq-len", "300", "--json")  # the tiny models have 256
    assert code == 0, err
    assert "warning: --seq-len 300 is longer than" in err and "256 positions" in err, err


@pytest.mark.parametrize("args, needle", [
    (["--seq-len", "1"], "--seq-len must be at least 2"),
    (["--max-windows", "0"], "--max-windows must be at least 1"),
    (["--stride", "0"], "--stride must be between 1"),
])
def test_eval_window_settings_fail_before_loading(tmp_path, cli, args, needle):
    code, _, err = cli("eval", tmp_path / "no-such-model", *args)  # the model is never reached
    assert code == 1 and needle in err, err


def test_cuda_without_gpu_fails_before_any_work(mla, tmp_path, cli, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for method in ("lossless", "transmla"):
        code, _, err = cli("convert", mla / "src", tmp_path / "out", "--method", method, "--device", "cuda")
        assert code == 1 and "no CUDA GPU" in err, err
        assert not (tmp_path / "out").exists()


def test_failed_finetune_leaves_nothing(mla, tmp_path):
    from transmla.finetune.recipe import parse_recipe
    from transmla.finetune.train import run_finetune

    out = tmp_path / "run"
    recipe = _recipe(mla, out)
    recipe["data"] = {**recipe["data"], "train": str(tmp_path / "missing.txt")}
    with pytest.raises(Exception, match="missing.txt"):
        run_finetune(parse_recipe(recipe), progress=False)
    assert not out.exists()


def test_finetuned_model_files_get_the_usual_mode(mla, tmp_path):
    import os
    import stat

    from transmla.finetune.recipe import parse_recipe
    from transmla.finetune.train import run_finetune

    old = os.umask(0o022)
    try:
        run_finetune(parse_recipe(_recipe(mla, tmp_path / "run", train={**_recipe(mla, tmp_path)["train"], "steps": 1})), progress=False)
    finally:
        os.umask(old)
    mode = stat.S_IMODE((tmp_path / "run" / "model" / "model.safetensors").stat().st_mode)
    assert mode == 0o644, oct(mode)


def test_progress_lines_when_stderr_is_not_a_terminal(mla, tmp_path, cli, monkeypatch):
    monkeypatch.setenv("TRANSMLA_PROGRESS_SECONDS", "0")
    (tmp_path / "t.txt").write_text(" ".join(f"w{i % 50}" for i in range(3000)))
    code, _, err = cli("convert", mla / "src", tmp_path / "out", "--method", "transmla", "--kv-budget", "0.5",
                       "--calib", tmp_path / "t.txt", "--calib-samples", "8", "--calib-seq-len", "16")
    assert code == 0, err
    lines = err.splitlines()
    for expected in ("calibrating layers 0/2 (", "calibrating layers 1/2 (", "calibrating layers 2/2 ("):
        assert any(line.startswith(expected) for line in lines), err
    assert any(line.startswith("calibrating layers 2/2") and line.endswith("elapsed, done)") for line in lines), err
    assert "━" not in err  # no bar drawn into a file


def test_progress_lines_are_periodic(capsys, monkeypatch):
    from transmla.progress import progress_bar

    monkeypatch.setenv("TRANSMLA_PROGRESS_SECONDS", "3600")
    assert list(progress_bar(range(50), "items")) == list(range(50))
    lines = capsys.readouterr().err.strip().splitlines()
    assert [line.split(" (")[0] for line in lines] == ["items 0/50", "items 50/50"]  # start and end, nothing between


# --- variants: other corrupt inputs and symlink layouts -----------------------------------------


def test_index_naming_a_shard_outside_the_folder_is_refused(mla, tmp_path, cli):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(mla / "src", src)
    (src / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../elsewhere.safetensors"}}))
    code, _, err = cli("convert", src, tmp_path / "out")
    assert code == 1 and "is not a file name" in err, err


def test_damaged_tokenizer_json_is_refused(mla, tmp_path, cli):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(mla / "src", src)
    (src / "tokenizer.json").write_text("garbage")
    code, _, err = cli("convert", src, tmp_path / "out")
    assert code == 1 and "tokenizer.json is not valid JSON" in err, err
    assert not (tmp_path / "out").exists()


def test_finetune_checkpoint_scratch_symlink_is_refused(mla, tmp_path):
    from transmla.finetune.recipe import parse_recipe
    from transmla.finetune.train import run_finetune

    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (out / "checkpoints" / ".step-000002.tmp").symlink_to(elsewhere)
    with pytest.raises(ValueError, match="symlink"):
        run_finetune(parse_recipe(_recipe(mla, out)), progress=False)
    assert list(elsewhere.iterdir()) == []


def test_eval_report_never_written_through_a_symlink(mla, tmp_path, cli):
    (tmp_path / "t.txt").write_text(" ".join(f"w{i % 50}" for i in range(400)))
    rep = tmp_path / "rep"
    rep.mkdir()
    precious = tmp_path / "precious.json"
    precious.write_text("keep")
    (rep / "report.json").symlink_to(precious)
    code, _, err = cli("eval", mla / "mla", "--data", tmp_path / "t.txt", "--seq-len", "32", "--report", rep)
    assert code == 1 and "symlink" in err, err
    assert precious.read_text() == "keep"
