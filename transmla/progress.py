"""Rich progress bars on stderr (results go to stdout)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

T = TypeVar("T")
stderr_console = Console(stderr=True)


def progress_bar(items: Iterable[T], description: str, enabled: bool = True, total: int | None = None) -> Iterator[T]:
    """Iterate with a progress bar (ETA) on stderr; a plain iterator when disabled."""
    if not enabled:
        yield from items
        return
    total = total if total is not None else (len(items) if hasattr(items, "__len__") else None)
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
            bar.advance(task)
