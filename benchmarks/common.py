"""What every benchmark shares: where results go, timestamped logging, JSON results and a resumable
result cache, and the machine record (transmla.machine.environment) written beside each result."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transmla.machine import environment as machine  # noqa: F401  (re-exported for the scripts)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
STOCK_PPL = ROOT / "benchmarks" / "engines_stock_ppl.py"
TRANSMLA = Path(sys.executable).parent / "transmla"  # the CLI of the interpreter running the benchmark


def stock_perplexities(folders: list[Path], windows: Path, import_transmla: bool, cwd: Path | None = None) -> list[dict]:
    """Each folder's perplexity on the windows file, scored by engines_stock_ppl.py in a process that
    imports transmla only when asked (without it, stock transformers loads an exported folder)."""
    cmd = [sys.executable, str(STOCK_PPL), str(windows), *map(str, folders)] + (["--import-transmla"] if import_transmla else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def transmla_json(*args: str) -> dict:
    """`transmla ARGS --json` run as a user runs it; its JSON output (the last error line if it fails)."""
    proc = subprocess.run([str(TRANSMLA), *args, "--json"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"transmla {' '.join(args)} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def load_json(path: Path) -> dict:
    """The JSON object in `path`, {} when there is none yet."""
    return json.loads(path.read_text()) if path.is_file() else {}


def save_json(path: Path, data: Any, *, indent: int = 1, sort_keys: bool = True, newline: bool = False,
              default: Callable[[Any], Any] | None = None) -> None:
    """Write `data` to `path` atomically (through a .tmp file) as json.dumps with these settings, plus a
    final newline when asked: each results file keeps the layout it has always had."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=indent, sort_keys=sort_keys, default=default) + ("\n" if newline else ""))
    tmp.replace(path)


class ResultCache:
    """Results by key in one JSON file; several processes may add to it. A save writes only the keys this
    process set or changed over what was on disk (a stale copy of another process's key never wins)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.results: dict[str, Any] = load_json(path)
        self._seen = self._snapshot(self.results)

    @staticmethod
    def _snapshot(results: dict[str, Any]) -> dict[str, str]:
        return {k: json.dumps(v, sort_keys=True, default=str) for k, v in results.items()}

    def save(self) -> None:
        now = self._snapshot(self.results)
        mine = {k: self.results[k] for k, v in now.items() if self._seen.get(k) != v}
        merged = {**load_json(self.path), **mine}
        self.results.clear()
        self.results.update(merged)  # in place: callers may hold self.results
        save_json(self.path, self.results)
        self._seen = self._snapshot(self.results)

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


def run_notes(named: dict[str, dict]) -> str:
    """A Markdown list of each entry's "note" (what the recorded CPU and load do not say: what else ran, how many
    threads; a benchmark's --note sets it), one item per note with the runs that have it; '' if none has one."""
    by_note: dict[str, list[str]] = {}
    for name, entry in named.items():
        if entry.get("note"):
            by_note.setdefault(entry["note"], []).append(name)
    if not by_note:
        return ""
    return "\n".join(["Notes on the runs:", "", *(f"- {', '.join(names)}: {note}." for note, names in by_note.items())])


def measured(log_file: Path) -> dict:
    """Peak RSS (GiB: /usr/bin/time's kilobytes are KiB) and wall time of a finished run from its /usr/bin/time -v log."""
    text = log_file.read_text()
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1))
    clock = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", text).group(1)
    seconds = sum(float(x) * 60 ** i for i, x in enumerate(reversed(clock.split(":"))))
    cpu = sum(float(re.search(rf"{kind} time \(seconds\): ([\d.]+)", text).group(1)) for kind in ("User", "System"))
    return {"peak_rss_gib": round(rss_kb / 2**20, 3), "wall_s": round(seconds, 1), "cpu_s": round(cpu, 1),
            "load_before": None, "load_after": None}


def timed(cmd: list[str], log_file: Path) -> dict:
    """Run `cmd` under /usr/bin/time -v; its peak RSS, wall time and the load around it."""
    before = os.getloadavg()
    start = time.perf_counter()
    with open(log_file, "w") as f:
        proc = subprocess.run(["/usr/bin/time", "-v", *cmd], stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode}); see {log_file}")
    return measured(log_file) | {"wall_s": round(time.perf_counter() - start, 1),
                                 "load_before": before, "load_after": os.getloadavg()}
