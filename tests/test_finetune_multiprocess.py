"""Fine-tuning on two processes (CPU, gloo) through `accelerate launch`, as the README says to run it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from test_finetune import _recipe, tiny  # noqa: F401  (the module's tiny model fixture)

TRANSMLA = Path(sys.executable).parent / "transmla"
ACCELERATE = Path(sys.executable).parent / "accelerate"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    # The launched processes import this checkout's transmla; no user accelerate config may leak
    # in (accelerate reads it under HF_HOME); one thread per process on the shared CPU.
    import transmla

    path = os.pathsep.join(filter(None, [str(Path(transmla.__file__).parent.parent), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "HF_HOME": "/nonexistent-hf-home",
            "ACCELERATE_CONFIG_FILE": "/nonexistent-accelerate-config.yaml"}


def _launch(processes: int, *command: str) -> list[str]:
    """accelerate's multi-process launch of `command` on the CPU, isolated from any user config."""
    return [str(ACCELERATE), "launch", "--multi_gpu", "--num_processes", str(processes), "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port()), *command]


def _finetune(recipe: dict, path: Path, processes: int, timeout: float = 240, *extra: str) -> subprocess.CompletedProcess:
    path.write_text(yaml.safe_dump(recipe))
    if processes == 1:
        cmd = [str(TRANSMLA), "finetune", str(path), "--json", *extra]
    else:
        cmd = _launch(processes, str(TRANSMLA), "finetune", str(path), "--json", *extra)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env())


def _reloaded(model_dir: Path) -> dict:
    from transformers import AutoModelForCausalLM

    from transmla.mla.model import register

    register()
    return AutoModelForCausalLM.from_pretrained(model_dir).state_dict()


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in json.loads((out / "metrics.json").read_text())["train_log"]]


@pytest.mark.slow
def test_two_processes_equal_one_with_the_same_global_batch(tiny, tmp_path):  # noqa: F811
    # 8 sequences per step either way: 1 process x 2 x grad_accum 4, or 2 processes x 2 x 2.
    one = _recipe(tiny, tmp_path / "one", train={"grad_accum": 4, "steps": 4, "log_every": 1})
    two = _recipe(tiny, tmp_path / "two", train={"grad_accum": 2, "steps": 4, "log_every": 1})
    r1 = _finetune(one, tmp_path / "one.yaml", 1)
    assert r1.returncode == 0, r1.stderr[-2000:]
    r2 = _finetune(two, tmp_path / "two.yaml", 2)
    assert r2.returncode == 0, r2.stderr[-2000:]
    a, b = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert len(a) == len(b) == 4
    assert torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-6), (a, b)
    assert a[-1] < a[0]  # it trained
    # One writer: the model, the logs and one checkpoint set, each once. The model reloads and
    # equals the one-process run's, parameter for parameter.
    wa, wb = _reloaded(tmp_path / "one" / "model"), _reloaded(tmp_path / "two" / "model")
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.allclose(wa[name], wb[name], rtol=1e-4, atol=1e-6), name
    summary = json.loads((tmp_path / "two" / "metrics.json").read_text())["summary"]
    assert summary["steps"] == 4 and summary["tokens"] == 4 * 8 * 32
    assert r2.stdout.count('"steps"') == 1  # the result is printed by the main process only
    evals = json.loads((tmp_path / "two" / "metrics.json").read_text())["eval_log"]
    assert len(evals) == len(json.loads((tmp_path / "one" / "metrics.json").read_text())["eval_log"])


@pytest.mark.slow
def test_resume_on_another_process_count(tiny, tmp_path):  # noqa: F811
    # Two processes stop after 2 of 4 steps; one process resumes with the same sequences per step
    # and ends where an uninterrupted one-process run ends. Another batch is refused, with the fix.
    out = tmp_path / "run"
    two = _recipe(tiny, out, train={"grad_accum": 2, "steps": 4, "log_every": 1}, checkpoint={"every": 2})
    r = _finetune(two, tmp_path / "two.yaml", 2, 240, "--set", "train.steps=2")
    assert r.returncode == 0, r.stderr[-2000:]
    bad = _recipe(tiny, out, train={"grad_accum": 2, "steps": 4}, checkpoint={"every": 2})
    r = _finetune(bad, tmp_path / "bad.yaml", 1)
    assert r.returncode == 1
    assert "was written by 2 processes taking 8 sequences per step; this run takes 4" in r.stderr
    assert "set train.grad_accum to 4" in r.stderr
    good = _recipe(tiny, out, train={"grad_accum": 4, "steps": 4, "log_every": 1}, checkpoint={"every": 2})
    r = _finetune(good, tmp_path / "good.yaml", 1)
    assert r.returncode == 0, r.stderr[-2000:]
    ref = _recipe(tiny, tmp_path / "ref", train={"grad_accum": 4, "steps": 4, "log_every": 1})
    assert _finetune(ref, tmp_path / "ref.yaml", 1).returncode == 0
    assert torch.allclose(torch.tensor(_losses(out)), torch.tensor(_losses(tmp_path / "ref")), rtol=1e-5, atol=1e-6)


def _worker_pid(recipe: Path, rank: int) -> int | None:
    """The launched worker of `rank` running `recipe` (found through /proc)."""
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            env = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if str(recipe).encode() in cmd and f"RANK={rank}".encode() in env and b"LOCAL_RANK=" + str(rank).encode() in env:
            return int(proc.name)
    return None


def _start_long_run(tiny: Path, tmp_path: Path, timeout_seconds: int):  # noqa: F811
    """A 2-process run that would go on for hours, and the pid of its second worker, well into the run."""
    import time

    recipe = _recipe(tiny, tmp_path / "run", train={"grad_accum": 2, "steps": 100000, "log_every": 1,
                                                     "timeout_seconds": timeout_seconds})
    path = tmp_path / "long.yaml"
    path.write_text(yaml.safe_dump(recipe))
    launcher = subprocess.Popen(_launch(2, str(TRANSMLA), "finetune", str(path)), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=_env())
    deadline = time.monotonic() + 120
    pid = None
    while pid is None and time.monotonic() < deadline and launcher.poll() is None:
        pid = _worker_pid(path, 1)
        time.sleep(0.5)
    time.sleep(8)  # into the run: loading, evaluating or training; every wait from here on is a collective
    return launcher, pid


# A dead worker (SIGKILL) is seen by the launcher, which stops the other; a hung one (SIGSTOP: alive,
# never answering) is not: the waiting process gives up after train.timeout_seconds. Both end the run
# with an error in bounded time instead of hanging.
@pytest.mark.slow
@pytest.mark.parametrize("how, timeout_seconds, expected", [
    ("SIGKILL", 30, ("SIGKILL", "Signal 9", "exitcode")),
    ("SIGSTOP", 10, ("another process did not answer within train.timeout_seconds (10 s)",)),
])
def test_a_dead_or_hung_process_ends_the_run(tiny, tmp_path, how, timeout_seconds, expected):  # noqa: F811
    import signal
    import time

    launcher, pid = _start_long_run(tiny, tmp_path, timeout_seconds)
    try:
        assert pid is not None, "the second worker never started"
        os.kill(pid, getattr(signal, how))
        start = time.monotonic()
        _, err = launcher.communicate(timeout=150)  # bounded: the timeout, then the launcher's shutdown
        assert launcher.returncode != 0
        assert time.monotonic() - start < 150
        assert any(e in err for e in expected), err[-3000:]
    finally:
        if pid is not None:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        if launcher.poll() is None:
            launcher.kill()


@pytest.mark.slow
def test_fsdp_two_processes_each_hold_half_and_save_a_model_that_reloads(tiny, tmp_path):  # noqa: F811
    # train.fsdp shards the trainable state over the 2 processes; the run equals a 1-process one
    # with the same sequences per step, and the gathered model reloads.
    one = _recipe(tiny, tmp_path / "one", train={"grad_accum": 4, "steps": 3, "log_every": 1})
    fsdp = _recipe(tiny, tmp_path / "fsdp", train={"grad_accum": 2, "steps": 3, "log_every": 1, "fsdp": True})
    r2 = _finetune(fsdp, tmp_path / "fsdp.yaml", 2)
    assert r2.returncode == 0, r2.stderr[-6000:]
    summary = json.loads((tmp_path / "fsdp" / "metrics.json").read_text())["summary"]
    held, trained = summary["trainable_per_process"], summary["trained_parameters"]
    assert len(held) == 2 and sum(held) == trained
    assert max(held) <= 0.6 * trained, held  # about half each (dim-0 shards of odd sizes round up)
    r1 = _finetune(one, tmp_path / "one.yaml", 1)
    assert r1.returncode == 0, r1.stderr[-2000:]
    a, b = _losses(tmp_path / "one"), _losses(tmp_path / "fsdp")
    assert torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-6), (a, b)
    s1, s2 = _reloaded(tmp_path / "one" / "model"), _reloaded(tmp_path / "fsdp" / "model")
    assert s1.keys() == s2.keys()
    for name in s1:
        assert torch.allclose(s1[name], s2[name], rtol=1e-4, atol=1e-6), name
    # Sharded runs write no checkpoints yet: a recipe asking for them is refused before it starts.
    stop = _recipe(tiny, tmp_path / "stop", train={"steps": 3, "fsdp": True}, checkpoint={"every": 1})
    r3 = _finetune(stop, tmp_path / "stop.yaml", 1)
    assert r3.returncode == 1
    assert "train.fsdp writes no checkpoints of its sharded state yet: set checkpoint.every to 0" in r3.stderr
    assert not (tmp_path / "stop").exists()


@pytest.mark.slow
def test_readme_launch_converts_then_trains(tiny, tmp_path):  # noqa: F811
    # The README's command shape (`-m transmla.cli.app`) with a recipe that converts its source
    # first: the first process converts while the other waits outside any collective, so a
    # conversion longer than train.timeout_seconds does not end the run.
    recipe = _recipe(tiny, tmp_path / "run", train={"grad_accum": 2, "steps": 2, "timeout_seconds": 20},
                     model={"path": None, "source": str(tiny / "src"),
                            "convert": {"method": "transmla", "kv_budget": 0.5, "calib_samples": 64, "calib_seq_len": 16}})
    del recipe["model"]["path"]
    path = tmp_path / "convert.yaml"
    path.write_text(yaml.safe_dump(recipe))
    slow_convert = tmp_path / "slow_convert.py"  # the conversion takes longer than the timeout
    slow_convert.write_text(
        "import time\nimport transmla.convert.api as api\n_convert = api.convert\n"
        f"def convert(*a, **k):\n    open({str(tmp_path / 'slowed')!r}, 'w').close()\n    time.sleep(35)\n"
        "    return _convert(*a, **k)\napi.convert = convert\n"
    )
    (tmp_path / "sitecustomize.py").write_text("import slow_convert  # noqa: F401\n")
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    cmd = _launch(2, "-m", "transmla.cli.app", "finetune", str(path), "--json")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "slowed").exists()  # the conversion really outlasted the timeout
    assert r.stdout.count('"steps"') == 1
    converted = tmp_path / "run" / "converted"
    assert json.loads((converted / "config.json").read_text())["mla"]["method"]["name"] == "transmla"
    assert len(_losses(tmp_path / "run")) == 2
    assert _reloaded(tmp_path / "run" / "model").keys()
