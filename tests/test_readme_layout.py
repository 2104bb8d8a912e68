"""The README's shape, and the layout section (docs/USAGE.md) naming every module of transmla/ and benchmarks/.

README.md is what a user reads first: what it does, the two commands, a five-minute path, one results
table whose every row links to its results file, and links to the detailed documents. Every relative
link in README.md and docs/ points at a file that exists (and, with an anchor, at a heading there).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ["docs/USAGE.md", "docs/RESULTS.md", "docs/LIMITS.md"]
MAX_README_LINES = 250


def headings(text: str) -> list[str]:
    """The "## " headings outside code blocks, in order."""
    out, in_code = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("## "):
            out.append(line[3:])
    return out


def section(text: str, title: str) -> str:
    """The text under "## title" up to the next "## " heading."""
    body = text.split(f"\n## {title}\n", 1)[1]
    return re.split(r"\n## ", body, maxsplit=1)[0]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text, in_code, found = path.read_text(), False, set()
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and (m := re.match(r"^#{1,6} (.*)$", line)):
            found.add(slug(m.group(1)))
    return found


def links(path: Path) -> list[str]:
    """Relative link targets of a Markdown file (code blocks skipped)."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", t)]


def layout_entries() -> dict[str, str]:
    """The layout block of docs/USAGE.md as {path: its description}: "transmla/convert/" -> "method (...), ..."."""
    text = (ROOT / "docs/USAGE.md").read_text()
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
    assert not missing, f"docs/USAGE.md's layout section does not name: {', '.join(missing)}"
    folders = [p for p in entries if p.endswith("/")]
    assert [p for p in folders if not (ROOT / p).is_dir()] == []


def test_readme_is_short_and_in_order():
    text = README.read_text()
    n = len(text.splitlines())
    assert n < MAX_README_LINES, f"README.md has {n} lines; keep it under {MAX_README_LINES} (details go to docs/)"
    assert text.startswith("# transmla\n\n") and "Multi-head Latent Attention" in text.split("\n## ", 1)[0]
    assert headings(text) == ["Two commands", "Five-minute path: convert, evaluate, serve", "Results", "More"]


def test_readme_two_commands_exact():
    """CI runs `make test`: its line (and `make demo`'s) stay word for word."""
    block = section(README.read_text(), "Two commands")
    assert "make demo   # set up .venv; convert the built-in SmolLM2-135M (lossless, and TransMLA at 25% of the KV cache); evaluate both against the source, offline\n" in block
    assert "make test   # set up .venv and run the test suite (what CI runs)\n" in block


def test_readme_five_minute_path_converts_evaluates_and_serves():
    path = section(README.read_text(), "Five-minute path: convert, evaluate, serve")
    for needle in ["transmla convert ", "transmla eval ", "import transmla", "--format deepseek",
                   "--format gguf", "llama-completion "]:
        assert needle in path, f"the five-minute path lacks {needle!r}"


def test_readme_results_table_rows_link_their_results_file_and_machine():
    rows = [l for l in section(README.read_text(), "Results").splitlines() if l.startswith("| ")]
    header, body = rows[0], rows[2:]
    assert "machine" in header and len(body) >= 5
    for row in body:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[2], f"a results row names no machine: {row}"
        assert re.search(r"\]\(benchmarks/results/[^)]+\.md\)", cells[-1]), f"a results row links no results file: {row}"


def test_readme_links_the_detailed_documents():
    targets = set(links(README))
    for doc in [*DOCS, "benchmarks/README.md", "transmla/mla/kernels/NOTES.md"]:
        assert doc in targets, f"README.md does not link {doc}"
    assert "docs/USAGE.md#adding-a-conversion-method" in targets


def test_every_relative_link_resolves():
    broken = []
    for md in [README, *(ROOT / d for d in DOCS)]:
        for target in links(md):
            file, _, anchor = target.partition("#")
            dest = (md.parent / file).resolve() if file else md
            if not dest.exists():
                broken.append(f"{md.relative_to(ROOT)}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{md.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "broken links: " + ", ".join(broken)
