"""Terminating signals end a command the way Ctrl-C does: as KeyboardInterrupt, so every `finally`
and `except BaseException` on the way out runs (temporary output folders are removed)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

# Signals whose default action ends the process; SIGKILL cannot be caught (stale temporary folders
# of killed runs are removed by the next run, see checkpoint/writer.py).
HANDLED = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2") if hasattr(signal, name)
)


@dataclass
class Caught:
    signum: int | None = None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""


@contextmanager
def interrupt_on_signals() -> Iterator[Caught]:
    """Within the block, the first handled signal raises KeyboardInterrupt; later ones are only
    recorded, so the clean-up the first one started can finish. Handlers are restored on exit."""
    caught = Caught()
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield caught
        return

    def handler(signum, frame):
        if caught.signum is None:
            caught.signum = signum
            raise KeyboardInterrupt

    previous = {s: signal.signal(s, handler) for s in HANDLED}
    try:
        yield caught
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
