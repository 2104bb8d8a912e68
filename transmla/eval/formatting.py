"""How reports write numbers: bytes, perplexities, Markdown tables (shared by every report)."""

from __future__ import annotations

from collections.abc import Sequence

MIB = 1024 * 1024


def format_bytes(n: float | None) -> str:
    if n is None:
        return "–"
    for unit, size in (("GiB", 1024**3), ("MiB", MIB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{int(n):,} B"


def format_ppl(x: float) -> str:
    return f"{x:,.2f}" if x < 1e5 else f"{x:.3g}"


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    esc = [[c.replace("|", "\\|") for c in r] for r in [header, *rows]]
    lines = ["| " + " | ".join(esc[0]) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in esc[1:]]
    return "\n".join(lines)


__all__ = ["MIB", "format_bytes", "format_ppl", "md_table"]
