"""Evaluation and calibration texts: offline built-ins, local files, Hugging Face datasets.

Built-in texts (real English shipped inside ``gensim==4.4.0``, read by path):

- ``wiki``: gensim's Wikipedia excerpt, cleaned by the ANCHORS.md protocol (see ``wiki_text``).
- ``lee``: the Lee news corpus ``lee_background.cor`` (see ``lee_text``).
- ``code``: the Python source of the running interpreter's standard library (see ``code_text``),
  so that a coder model's calibration can see code without a download.

``wiki`` and ``lee`` are split by characters: the first 80% is the calibration part (``calib``),
the last 20% the evaluation part (``eval``). ``code`` is split by module name: modules a..m
calibrate, modules n..z evaluate. Always ``calib + eval == all`` and they never overlap.
"""

from __future__ import annotations

import bz2
import functools
import importlib.util
import json
import os
import re
import sysconfig
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Literal

__all__ = [
    "BUILTIN_TEXTS",
    "CALIB_FRACTION",
    "TextSourceError",
    "builtin_text",
    "code_calib_files",
    "code_text",
    "gensim_test_data",
    "read_jsonl_rows",
    "lee_text",
    "load_text",
    "split_text",
    "wiki_text",
]

Part = Literal["calib", "eval", "all"]
PARTS: tuple[str, ...] = ("calib", "eval", "all")
BUILTIN_TEXTS: tuple[str, ...] = ("wiki", "lee", "code")
CALIB_FRACTION = 0.8
WIKI_FILE = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
LEE_FILE = "lee_background.cor"
MIN_ARTICLE_WORDS = 200

_OFFLINE_HINT = "offline choices: the built-in texts 'wiki', 'lee', 'code', or a local .txt/.jsonl file"


class TextSourceError(ValueError):
    """A text source that cannot be read or fetched (one-line message)."""


def gensim_test_data() -> Path:
    """gensim's ``test/test_data`` folder, found without importing gensim."""
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise TextSourceError(
            "the built-in texts come from gensim's test data: pip install gensim==4.4.0"
        )
    folder = Path(next(iter(spec.submodule_search_locations))) / "test" / "test_data"
    if not folder.is_dir():
        raise TextSourceError(f"gensim has no test data at {folder}: pip install gensim==4.4.0")
    return folder


# --- wiki ------------------------------------------------------------------------------------

# Lines that are left-over table markup after filter_wiki: table start/end "{|", "|}",
# row/cell lines starting with "|" or "!", and unexpanded template braces "{{", "}}".
_MARKUP_LINE = re.compile(r"^\s*(\{\||\|\}|\||!|\{\{|\}\})")
_BLANK_RUNS = re.compile(r"\n{2,}")


def _wiki_pages(path: Path) -> list[tuple[str, str]]:
    """(title, raw wikitext) of every page of namespace 0 that is not a redirect."""
    pages: list[tuple[str, str]] = []
    with bz2.open(path, "rb") as f:
        for _, elem in ET.iterparse(f, events=("end",)):
            if elem.tag.rsplit("}", 1)[-1] != "page":
                continue
            ns = elem.findtext("{*}ns")
            redirect = elem.find("{*}redirect") is not None
            if ns == "0" and not redirect:
                title = elem.findtext("{*}title") or ""
                raw = elem.findtext("{*}revision/{*}text") or ""
                pages.append((title, raw))
            elem.clear()
    return pages


def _clean_article(raw: str) -> str:
    """One article's plain text: filter_wiki, markup lines and '' / ''' quotes removed."""
    from gensim.corpora.wikicorpus import filter_wiki  # slow import, only when needed

    text = filter_wiki(raw)  # 1. gensim's markup filter (links, templates, refs, tags, ...)
    lines = []
    for line in text.split("\n"):
        if _MARKUP_LINE.match(line):  # 2. drop table / template left-over lines
            continue
        line = line.replace("'''", "").replace("''", "")  # 3. bold / italic quotes
        lines.append(line.strip())  # 4. strip each line
    text = "\n".join(lines)
    return _BLANK_RUNS.sub("\n\n", text).strip()  # 5. paragraphs by one blank line


def wiki_text() -> str:
    """The whole built-in ``wiki`` text (about 3.0 MB), by the ANCHORS.md protocol.

    Pages of namespace 0 that are not redirects; each cleaned by ``_clean_article``; articles
    under 200 words (whitespace split) dropped; each article headed " = Title = " and followed
    by a blank line; articles joined by blank lines.
    """
    articles = []
    for title, raw in _wiki_pages(gensim_test_data() / WIKI_FILE):
        body = _clean_article(raw)
        if len(body.split()) < MIN_ARTICLE_WORDS:
            continue
        articles.append(f" = {title} = \n\n{body}")
    return "\n\n".join(articles)


# --- lee -------------------------------------------------------------------------------------


def lee_text() -> str:
    """The whole built-in ``lee`` text: one news story per line, joined by blank lines."""
    raw = (gensim_test_data() / LEE_FILE).read_text(encoding="utf-8")
    return "\n\n".join(line.strip() for line in raw.splitlines() if line.strip())


# --- code ------------------------------------------------------------------------------------

CODE_EVAL_FROM = "n"  # modules whose names sort before this letter calibrate, the rest evaluate
_FILE_SEP = "\n\n"


def _stdlib_modules() -> list[Path]:
    """The top-level ``*.py`` modules of this interpreter's standard library, sorted by name."""
    folder = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(folder.glob("*.py"))
    if not files:
        raise TextSourceError(f"the built-in text 'code' reads the standard library, but {folder} has no .py files")
    return files


def code_calib_files() -> list[Path]:
    """The files of the calibration part of ``code``: the top-level modules a..m (eval/code_task.py
    draws its held-out functions from everything else)."""
    return [p for p in _stdlib_modules() if p.name[0] < CODE_EVAL_FROM]


def code_text() -> tuple[str, str]:
    """The built-in ``code`` text as (calib, eval): the standard library's modules a..m joined by blank
    lines (ending with one) and modules n..z joined the same way. It depends on the Python version."""
    read = lambda p: p.read_text(encoding="utf-8", errors="replace")  # noqa: E731
    calib_files = code_calib_files()
    calib = [read(p) for p in calib_files]
    ev = [read(p) for p in _stdlib_modules() if p not in calib_files]
    return _FILE_SEP.join(calib) + _FILE_SEP, _FILE_SEP.join(ev)


# --- parts -----------------------------------------------------------------------------------


def split_text(text: str, part: str) -> str:
    """The ``calib`` (first 80% of characters), ``eval`` (last 20%) or ``all`` part."""
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    cut = int(len(text) * CALIB_FRACTION)
    return {"calib": text[:cut], "eval": text[cut:], "all": text}[part]


@functools.lru_cache(maxsize=None)
def _builtin_parts(name: str) -> tuple[str, str]:
    """(calib, eval) of a built-in text."""
    if name == "code":
        return code_text()
    whole = {"wiki": wiki_text, "lee": lee_text}[name]()
    return split_text(whole, "calib"), split_text(whole, "eval")


@functools.lru_cache(maxsize=None)
def builtin_text(name: str, part: Part = "eval") -> str:
    """A part of a built-in text (``wiki``, ``lee`` or ``code``), cached in memory."""
    if name not in BUILTIN_TEXTS:
        raise TextSourceError(f"unknown built-in text {name!r}; built-ins: {', '.join(BUILTIN_TEXTS)}")
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    calib, ev = _builtin_parts(name)
    return {"calib": calib, "eval": ev, "all": calib + ev}[part]


# --- local files and datasets ----------------------------------------------------------------

_TEXT_SUFFIXES = {".txt", ".text", ".md", ".jsonl", ".json", ".csv", ".tsv"}
# name | owner/name, then optional :config and :split
_DATASET_SPEC = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?(:[\w.\-+\[\]%]*){0,2}$")
# common aliases -> (hub dataset, config)
_DATASET_ALIASES: dict[str, tuple[str, str]] = {
    "wikitext-2-raw-v1": ("wikitext", "wikitext-2-raw-v1"),
    "wikitext-2-v1": ("wikitext", "wikitext-2-v1"),
    "wikitext-103-raw-v1": ("wikitext", "wikitext-103-raw-v1"),
    "wikitext-103-v1": ("wikitext", "wikitext-103-v1"),
    "wikitext2": ("wikitext", "wikitext-2-raw-v1"),
}
_DEFAULT_SPLIT = {"eval": "test", "calib": "train", "all": "train"}


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def read_jsonl_rows(path: Path, text_field: str, hint: str = "choose it with text_field") -> list[str]:
    """The `text_field` value of every non-blank row of a UTF-8 JSONL file; TextSourceError naming
    the line otherwise (`hint` says how to pick the field)."""
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise TextSourceError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict) or text_field not in row:
                raise TextSourceError(f"{path}:{lineno}: no field {text_field!r} ({hint})")
            rows.append(str(row[text_field]))
    return rows


def _looks_like_dataset(spec: str) -> bool:
    if spec.startswith(("/", ".", "~")) or "\\" in spec:
        return False
    if Path(spec.split(":", 1)[0]).suffix.lower() in _TEXT_SUFFIXES:
        return False
    return bool(_DATASET_SPEC.match(spec))


def _parse_dataset_spec(spec: str, part: str) -> tuple[str, str | None, str]:
    name, config, split = (spec.split(":") + [None, None])[:3]
    if name in _DATASET_ALIASES and config is None:
        name, config = _DATASET_ALIASES[name]
    return name, config or None, split or _DEFAULT_SPLIT[part]


def _load_dataset_text(spec: str, part: str, text_field: str) -> str:
    name, config, split = _parse_dataset_spec(spec, part)
    try:
        import datasets  # noqa: F401  (optional dependency)
    except ImportError:
        raise TextSourceError(
            f"could not fetch dataset {spec!r}: the 'datasets' package is not installed; "
            + _OFFLINE_HINT
        ) from None
    # Fail fast where the hub is unreachable rather than hang on retries.
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "5")
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "10")
    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # noqa: BLE001  (network, offline mode, missing dataset, ...)
        raise TextSourceError(
            f"could not fetch dataset {spec!r} ({_one_line(e)}); " + _OFFLINE_HINT
        ) from None
    if text_field not in ds.column_names:
        raise TextSourceError(
            f"dataset {spec!r} has no field {text_field!r} (columns: {', '.join(ds.column_names)})"
        )
    return "\n\n".join(str(t) for t in ds[text_field])


def load_text(spec: str, part: str = "eval", text_field: str = "text") -> str:
    """The text named by ``spec``.

    - ``wiki`` / ``lee`` / ``code``: that part of the built-in text;
    - a UTF-8 ``.jsonl`` file: its ``text_field`` values joined by blank lines (whole file);
    - any other existing file: read whole as UTF-8 (``part`` is ignored for files);
    - otherwise a Hugging Face datasets spec ``name[:config[:split]]``, e.g.
      ``wikitext:wikitext-2-raw-v1:test`` or the alias ``wikitext-2-raw-v1``; the split
      defaults to ``test`` for ``eval`` and ``train`` for ``calib``.
    """
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    if spec in BUILTIN_TEXTS:
        return builtin_text(spec, part)  # type: ignore[arg-type]
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix.lower() == ".jsonl":
            return "\n\n".join(read_jsonl_rows(path, text_field))
        try:
            return path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise TextSourceError(f"{path}: not UTF-8 text ({e.reason})") from None
    if path.exists():
        raise TextSourceError(f"not a file: {spec}")
    if not _looks_like_dataset(spec):
        raise TextSourceError(f"no such file: {spec}")
    return _load_dataset_text(spec, part, text_field)
