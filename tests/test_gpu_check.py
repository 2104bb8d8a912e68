"""tools/gpu_check.py on the CPU: what can be checked before a lent GPU machine runs it (the set-up
check, the stage loop and its reports, the host-side integer helpers of the Triton launcher).
The whole dry run (`make gpu-dry-run`, every stage with tiny shapes) takes minutes: not here."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parent.parent
HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


def _fake_prep(prep: Path, gpu_check) -> None:
    (prep / "smollm2").mkdir(parents=True)
    for name in gpu_check.SMOLLM2_FILES:
        (prep / "smollm2" / name).write_text("{}")
    (prep / "wheels").mkdir()
    for stem in ("pydantic-2", "pydantic_core-2", "gguf-0", "gensim-4"):
        (prep / "wheels" / f"{stem}-py3-none-any.whl").write_bytes(b"")


def test_unprepared_set_up_is_refused_with_exit_2(gpu_check, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "PREP", tmp_path / "nothing")
    assert gpu_check.check_prepared(tmp_path / "nothing")  # every missing file is named
    assert gpu_check.main(["--out", str(tmp_path / "out")]) == 2
    assert "make gpu-prep" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_dry_run_of_the_fast_stages_writes_both_reports(gpu_check, tmp_path, monkeypatch):
    prep = tmp_path / "prep"
    _fake_prep(prep, gpu_check)
    assert gpu_check.check_prepared(prep) == []
    monkeypatch.setattr(gpu_check, "PREP", prep)
    monkeypatch.setattr(gpu_check, "check_prepared", lambda dest=prep: [])
    out = tmp_path / "out"
    rc = gpu_check.main(["--dry-run", "--out", str(out), "--work", str(tmp_path / "work"),
                         "--stages", "environment,decode_bench,decode_tune"])
    report = json.loads((out / "gpu_check.json").read_text())
    assert rc == 0 and report["dry_run"]
    assert set(report["stages"]) == {"environment", "decode_bench", "decode_tune"}
    tune = report["stages"]["decode_tune"]
    assert [x["label"] for x in tune["shapes"]] == [label for label, _ in gpu_check.tune_grid(True)]
    for x in tune["shapes"]:  # the default is among the timed configs, and the best is no slower
        assert 1 < x["configs"] <= gpu_check.TUNE_CONFIGS and x["best_ms"] <= x["default_ms"]
    bench = report["stages"]["decode_bench"]
    assert bench["ok"] and len(bench["rows"]) == len(gpu_check.decode_grid(True))
    for row in bench["rows"]:  # the ratios are what the numbers say
        assert row["speedup_vs_sdpa"] == pytest.approx(row["sdpa_ms"] / row["kernel_ms"])
        assert row["of_ideal"] == pytest.approx(row["speedup_vs_sdpa"] / row["bytes_ideal"])
    md = (out / "gpu_check.md").read_text()
    assert "DRY RUN" in md and "| decode_bench | pass |" in md and "| model | not run |" in md
    assert "| decode_tune | pass |" in md and "## Launch search" in md


def test_a_stage_that_raises_is_recorded_and_the_next_runs(gpu_check, tmp_path, monkeypatch):
    prep = tmp_path / "prep"
    _fake_prep(prep, gpu_check)
    monkeypatch.setattr(gpu_check, "check_prepared", lambda dest=prep: [])

    def broken(ctx):
        raise RuntimeError("planted failure")

    ran = []
    stages = [("environment", broken, 0), ("kernel_tests", lambda ctx: ran.append(1) or {"ok": True}, 0)]
    monkeypatch.setattr(gpu_check, "STAGES", stages)
    rc = gpu_check.main(["--dry-run", "--out", str(tmp_path / "out"), "--stages", "environment,kernel_tests"])
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert rc == 1 and ran == [1]
    assert report["stages"]["environment"]["error"] == "RuntimeError: planted failure"
    assert report["stages"]["kernel_tests"]["ok"]


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_host_integer_helpers_equal_tritons():
    import triton

    from transmla.mla.kernels import triton_decode as td

    assert all(td._next_pow2(n) == triton.next_power_of_2(n) for n in range(1, 5000))
    assert all(td._cdiv(a, b) == triton.cdiv(a, b) for a in range(0, 400) for b in range(1, 50))
