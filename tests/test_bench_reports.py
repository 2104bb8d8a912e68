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
