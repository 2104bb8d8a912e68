"""Progress on stderr (results go to stdout): the one place every long loop reports from.

On a terminal: a Rich bar with an ETA. Otherwise (stderr piped to a file or a log collector) plain
lines: one when the loop starts, then at most one every ``TRANSMLA_PROGRESS_SECONDS`` seconds
(default 10), and one when it ends, so a long run shows it is alive without flooding a log.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

T = TypeVar("T")
stderr_console = Console(stderr=True)
DEFAULT_PLAIN_INTERVAL = 10.0


def _plain_interval() -> float:
    try:
        return max(0.0, float(os.environ.get("TRANSMLA_PROGRESS_SECONDS", DEFAULT_PLAIN_INTERVAL)))
    except ValueError:
        return DEFAULT_PLAIN_INTERVAL


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _plain_lines(items: Iterable[T], description: str, total: int | None, size: Callable[[T], int]) -> Iterator[T]:
    interval = _plain_interval()
    start = last = time.monotonic()
    done = 0

    def line(final: bool = False) -> None:
        elapsed = time.monotonic() - start
        of = f"/{total}" if total is not None else ""
        if final:
            eta = "done"
        elif total and done:
            eta = f"eta {_clock(elapsed / done * (total - done))}"
        else:
            eta = "eta ?"
        stderr_console.print(f"{description} {done}{of} ({_clock(elapsed)} elapsed, {eta})", highlight=False, soft_wrap=True)

    line()
    for item in items:
        yield item
        done += size(item)
        now = time.monotonic()
        if now - last >= interval and (total is None or done < total):
            line()
            last = now
    line(final=True)


def progress_bar(
    items: Iterable[T], description: str, enabled: bool = True, total: int | None = None,
    size: Callable[[T], int] = lambda item: 1,
) -> Iterator[T]:
    """Iterate with progress on stderr (a bar with ETA on a terminal, periodic lines otherwise);
    a plain iterator when disabled. ``size(item)`` is how far one item advances (default 1)."""
    if not enabled:
        yield from items
        return
    total = total if total is not None else (len(items) if hasattr(items, "__len__") else None)
    if not stderr_console.is_terminal:
        yield from _plain_lines(items, description, total, size)
        return
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=stderr_console,
        transient=False,
    ) as bar:
        task = bar.add_task(description, total=total)
        for item in items:
            yield item
            bar.advance(task, size(item))


@contextmanager
def heartbeat(description: str, enabled: bool = True, expected_seconds: float | None = None) -> Iterator[None]:
    """Progress for one long step that has no loop to count (a prefill, a timed repetition): a line
    when it starts, then one every ``TRANSMLA_PROGRESS_SECONDS`` seconds (default 10) from a
    background thread, with an estimate when ``expected_seconds`` is known, and one when it ends.
    The thread only sleeps and prints, so it does not disturb what is being timed."""
    if not enabled:
        yield
        return
    interval = max(_plain_interval(), 0.05)
    start = time.monotonic()
    done = threading.Event()

    def line(state: str) -> None:
        stderr_console.print(f"{description} ({_clock(time.monotonic() - start)} elapsed, {state})",
                             highlight=False, soft_wrap=True)

    def beat() -> None:
        while not done.wait(interval):
            left = None if expected_seconds is None else expected_seconds - (time.monotonic() - start)
            line("eta ?" if left is None else f"eta {_clock(left)}" if left > 0 else "longer than the estimate")

    line("eta ?" if expected_seconds is None else f"eta {_clock(expected_seconds)}")
    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        line("done")
