"""The project's own warnings: a category of their own, so the CLI can silence libraries' warnings
without silencing ours, and print ours as one plain line."""

from __future__ import annotations

import warnings


class TransMLAWarning(UserWarning):
    """Something the user asked for works, but not as they probably expect (e.g. no cache saving)."""


def warn(message: str) -> None:
    warnings.warn(message, TransMLAWarning, stacklevel=3)
