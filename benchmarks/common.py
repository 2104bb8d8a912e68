"""What every benchmark shares: where results go, timestamped logging, JSON results and a resumable
result cache, and the machine record (transmla.eval.report.environment) written beside each result."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transmla.eval.report import environment as machine  # noqa: F401  (re-exported for the scripts)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def load_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


class ResultCache:
    """Results by key in one JSON file; several processes may add to it (merged on save, ours win)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.results: dict[str, Any] = load_json(path)

    def save(self) -> None:
        merged = {**load_json(self.path), **self.results}
        self.results.clear()
        self.results.update(merged)  # in place: callers may hold self.results
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.results, indent=1, sort_keys=True))
        tmp.replace(self.path)

    def cached(self, key: str, fn: Callable[[], Any]) -> Any:
        """fn()'s value under `key`, computed (and saved, with its seconds) only when missing."""
        if key not in self.results:
            start = time.perf_counter()
            value = fn()
            if isinstance(value, dict):
                value.setdefault("seconds", round(time.perf_counter() - start, 1))
            self.results[key] = value
            self.save()
            log(f"{key}: {value}")
        return self.results[key]
