"""Benchmark reports compare speeds only between rows measured on the same CPU."""

from __future__ import annotations

import json

import benchmarks.ik_llama_cpp as ik_bench

XEON = {"machine": "2-core CPU (Intel(R) Xeon(R) Processor, x86_64)"}
EPYC = {"machine": "2-core CPU (AMD EPYC, x86_64)"}


def _entry(machine: dict, tokens_per_s: float, kept_from: dict | None = None) -> dict:
    row = {"samples_ts": [tokens_per_s]}
    if kept_from is not None:  # a row kept from an earlier run on another machine (ik_bench.record)
        row["measured"] = {"machine": kept_from}
    return {"machine": machine, "rows": {"pp512": row}}


def test_ik_report_gives_no_ratio_across_cpus(tmp_path, monkeypatch):
    data = {"prompt": {
        "ik|m|source|f16|t1": _entry(EPYC, 200.0),
        "ik|m|conversion flash-mla|f16|t1": _entry(EPYC, 100.0),
        "ik|m|conversion flash-absorbed|f16|t1": _entry(XEON, 300.0),
        "ik|m|conversion gemm|f16|t1": _entry(EPYC, 50.0, kept_from=XEON),  # the entry's latest run is not the row's
    }}
    (tmp_path / "ik.json").write_text(json.dumps(data))
    monkeypatch.setattr(ik_bench, "OUT_JSON", tmp_path / "ik.json")
    monkeypatch.setattr(ik_bench, "OUT_MD", tmp_path / "ik.md")
    ik_bench.phase_report()
    rows = {line.split(" | ")[2]: line for line in (tmp_path / "ik.md").read_text().splitlines() if line.startswith("| ik |")}
    assert "| AMD EPYC | 100.0 | 0.50x |" in rows["conversion flash-mla"]
    assert "| Intel(R) Xeon(R) Processor | 300.0 | other CPU |" in rows["conversion flash-absorbed"]
    assert "| Intel(R) Xeon(R) Processor | 50.0 | other CPU |" in rows["conversion gemm"]


def test_measured_reads_peak_rss_as_kib(tmp_path):
    """/usr/bin/time -v's "kbytes" are KiB: 2,839,328 of them are 2.708 GiB (2.91 GB, not 2.84)."""
    from benchmarks.common import measured

    log = tmp_path / "time.log"
    log.write_text("\tUser time (seconds): 5000.50\n\tSystem time (seconds): 12.25\n"
                   "\tElapsed (wall clock) time (h:mm:ss or m:ss): 1:35:41.02\n"
                   "\tMaximum resident set size (kbytes): 2839328\n")
    got = measured(log)
    assert got["peak_rss_gib"] == 2.708 and "peak_rss_gb" not in got
    assert got["wall_s"] == 5741.0 and got["cpu_s"] == 5012.8


def test_run_notes_group_runs_by_note():
    from benchmarks.common import run_notes

    assert run_notes({"a": {}, "b": {"note": ""}}) == ""
    text = run_notes({"a": {"note": "two threads"}, "b": {}, "c": {"note": "one core; the other busy"},
                      "d": {"note": "two threads"}})
    assert text.splitlines() == ["Notes on the runs:", "", "- a, d: two threads.", "- c: one core; the other busy."]


def test_eval_memory_reads_the_eval_json_before_the_time_report():
    from benchmarks.eval_memory import eval_json

    doc = {"model": "out/m", "perplexity": 27.5, "source": {"model": "smollm2-135m", "perplexity": 18.0}}
    text = json.dumps(doc, indent=2) + "\n\tCommand being timed: \"transmla eval ...\"\n\tMaximum resident set size (kbytes): 1633148\n"
    assert eval_json("perplexity 8/8 (done)\n" + text) == doc


def test_ladder_twin_plans_match_across_fields_added_since():
    """A variant reuses its fit-free twin's stages when the twin's recorded plan is its plan: a field the record lacks
    (added to the plans after the twin ran) counts as its default, any other difference as another plan."""
    from dataclasses import replace

    from benchmarks.retrieval_ladder import same_plan
    from transmla.convert.transmla.method import TransMLAPlan

    plan = TransMLAPlan(kv_lora_rank=128, rope_dim=64)
    recorded = plan.to_dict()
    before_rotation = {k: v for k, v in recorded.items() if k != "rotation"}
    assert same_plan(recorded, plan) and same_plan(before_rotation, plan)
    assert not same_plan(before_rotation, replace(plan, rotation="unitary"))
    assert not same_plan(recorded, replace(plan, kv_lora_rank=96))
    assert not same_plan({**recorded, "retired": 1}, plan)
