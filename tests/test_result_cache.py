"""benchmarks.common.ResultCache: several benchmark processes share one results file."""

from __future__ import annotations

from benchmarks.common import ResultCache


def test_a_stale_copy_never_overwrites_another_process_s_key(tmp_path):
    path = tmp_path / "results.json"
    first = ResultCache(path)
    first.results["row"] = {"dev32": 1.0}
    first.save()
    second = ResultCache(path)  # holds row as it was then
    first.results["row"] = {"dev32": 1.0, "final": 2.0}
    first.save()
    second.results["other"] = 3
    second.save()
    assert ResultCache(path).results == {"row": {"dev32": 1.0, "final": 2.0}, "other": 3}
    assert second.results["row"] == {"dev32": 1.0, "final": 2.0}  # the save brought the newer row in


def test_cached_computes_once(tmp_path):
    path = tmp_path / "results.json"
    calls = []
    for _ in range(2):
        value = ResultCache(path).cached("key", lambda: calls.append(1) or {"x": 1})
    assert calls == [1] and value["x"] == 1 and "seconds" in value
