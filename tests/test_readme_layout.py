"""The README's layout section names every module of transmla/ and benchmarks/, under its folder."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def layout_entries() -> dict[str, str]:
    """README's layout block as {path: its description}: "transmla/convert/" -> "method (...), ..."."""
    text = (ROOT / "README.md").read_text()
    block = text.split("## How the pieces fit\n\n```\n", 1)[1].split("```\n", 1)[0]
    entries: dict[str, str] = {}
    stack: list[tuple[int, str]] = []  # (indent, folder path) of the open folders
    current = None
    for line in block.splitlines():
        m = re.match(r"^( *)(\S+)( +(.*))?$", line)
        indent, name, rest = len(m.group(1)), m.group(2), m.group(4) or ""
        if indent >= 20:  # a description continued on the next line
            entries[current] += " " + line.strip()
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        current = (stack[-1][1] if stack else "") + name
        entries[current] = rest
        if name.endswith("/"):
            stack.append((indent, current))
    return entries


def test_readme_layout_names_every_module():
    entries = layout_entries()
    missing = []
    for path in sorted([*ROOT.glob("transmla/**/*.py"), *ROOT.glob("benchmarks/*.py")]):
        rel = path.relative_to(ROOT)
        if rel.name == "__init__.py":
            continue
        folder, stem = f"{rel.parent.as_posix()}/", rel.stem
        if f"{folder}{stem}" in entries or re.search(rf"\b{stem}\b", entries.get(folder, "")):
            continue
        missing.append(rel.as_posix())
    assert not missing, f"README's layout section does not name: {', '.join(missing)}"
    folders = [p for p in entries if p.endswith("/")]
    assert [p for p in folders if not (ROOT / p).is_dir()] == []
