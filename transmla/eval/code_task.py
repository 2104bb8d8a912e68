"""Code completion (``transmla eval --task code``): held-out functions of the installed Python's
standard library, the coder model's own skill, built from what every CPython install holds.

Functions: the ``*.py`` files under the running interpreter's stdlib folder
(``sysconfig.get_paths()["stdlib"]``) that belong to a module of ``sys.stdlib_module_names``, less
``test``/``tests``/``idle_test`` folders and the parts Linux distributions ship as separate packages
(tkinter, idlelib, turtle, lib2to3, distutils, ensurepip, venv: ``SPLIT_OFF``), so every CPython of a
version holds the same files. Files are ranked by a hash of (``task_seed``, path), so a file missing
somewhere removes only its own item, and parsed with ``ast`` in that order; from each file one function
(or method) is drawn among those with a docstring and a body of 1..24 lines after it (not a bare
``pass``/``...``). The items change with the Python version (the result names it).

Held out from calibration: the built-in calibration text ``code`` (data/texts.py, ``--calib code``) is
Python source too, the stdlib's top-level modules a..m. Those files are never drawn, and a function whose
source (indentation ignored) appears anywhere in that calibration text is skipped, so no item was seen
while converting. (The top-level modules n..z are the evaluation part of ``code``, ``--data code``: held
out from calibration as well.)

Each item: the prompt is the function's decorators, signature and docstring, after up to
``context_tokens`` tokens of the module text before it; the target is the true body (the lines after the
docstring, cut at ``body_tokens`` tokens). Measured:

(a) ``nll``: mean negative log-likelihood per token of the true bodies given their prompts (over all
    body tokens of all items; ``perplexity`` is its exp), teacher-forced;
(b) ``exact_match``: the share of items whose first non-empty body line, generated greedily through the
    model's own cache (passkey.greedy_answerer: the latent cache for MLA models), equals the true one,
    whitespace at either end ignored;
(c) with ``choices`` > 1, the true body against bodies of other functions of about the same length
    (re-indented to the true body's indentation), scored by log-likelihood as the cloze task
    (choice_tasks): ``acc`` and ``acc_norm`` (per character).

Items are seeded and tokenizer-free (the same functions for every model); the prompt runs once and its
cache serves every candidate in one batched step (choice_tasks.candidate_loglik; the true one gives (a)),
one greedy generation gives (b). Nothing here parses flags or prints.
"""

from __future__ import annotations

import ast
import functools
import gc
import hashlib
import math
import random
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..schema import option
from .choice_tasks import candidate_loglik, choice_hits

TASK = "code"
EXCLUDED_FOLDERS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})
# Top-level stdlib modules that distributions package apart (Debian: python3-tk, idle, python3-lib2to3,
# python3-distutils, python3-venv, the test suite): absent from some installs, so never drawn.
SPLIT_OFF = frozenset({"test", "tkinter", "idlelib", "turtle", "turtledemo", "lib2to3", "distutils", "ensurepip",
                       "venv", "pydoc_data"})
MAX_BODY_LINES = 24
MAX_CHOICES = 16
LINE_MARGIN = 8  # tokens generated beyond the true first line's (a greedy line may tokenize differently)
CONTEXT_CHARS_PER_TOKEN = 8  # module text read before the function, per token of context wanted


@dataclass
class CodeSettings:
    """The code-completion protocol. It shares --items, --choices, --context-tokens and --task-seed with
    the choice tasks (their help, in ChoiceSettings, names this task's defaults); --body-tokens is its own."""

    items: int = 50
    choices: int = 4
    context_tokens: int = 512
    task_seed: int = 0
    body_tokens: int = option(128, "code: tokens of each function body scored, at most (longer bodies are cut).")

    def __post_init__(self) -> None:
        """Checked before any model loads (one-line errors naming the setting)."""
        if self.items < 1:
            raise ValueError(f"items must be at least 1, got {self.items}")
        if not 1 <= self.choices <= MAX_CHOICES:
            raise ValueError(f"choices must be between 1 and {MAX_CHOICES} for --task code (1: no choice scoring), "
                             f"got {self.choices}")
        if self.context_tokens < 0:
            raise ValueError(f"context_tokens must be 0 or more, got {self.context_tokens}")
        if self.body_tokens < 1:
            raise ValueError(f"body_tokens must be at least 1, got {self.body_tokens}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class StdlibFunction:
    module: str  # path relative to the stdlib folder
    name: str  # qualified name, e.g. "Mailbox.get_string"
    lineno: int  # first line of the function (its first decorator)
    context: str  # the module text before it (at most CONTEXT_CHARS_PER_TOKEN x context_tokens characters)
    header: str  # decorators, signature and docstring, no trailing newline
    body: str  # the lines after the docstring up to the last statement, newline-joined

    @property
    def first_line(self) -> str:
        return first_line(self.body)


@dataclass
class CodeItem:
    function: StdlibFunction
    candidates: list[str] = field(default_factory=list)  # bodies, the true one among them
    answer: int = 0  # index of the true body


def first_line(text: str) -> str:
    """The first line of ``text`` holding more than whitespace ('' if none)."""
    return next((line for line in text.splitlines() if line.strip()), "")


# --- the functions ------------------------------------------------------------------------------


def stdlib_folder() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@functools.lru_cache(maxsize=None)
def held_out_files() -> tuple[str, ...]:
    """The stdlib's .py files (relative paths, sorted) of its own modules (sys.stdlib_module_names, less
    SPLIT_OFF) outside test folders, less the files of the calibration text 'code'."""
    from ..data.texts import code_calib_files

    root = stdlib_folder()
    calib = {p.resolve() for p in code_calib_files()}
    modules = set(sys.stdlib_module_names) - SPLIT_OFF
    files = [p for p in root.rglob("*.py")
             if not EXCLUDED_FOLDERS & set(p.relative_to(root).parts[:-1]) and p.resolve() not in calib
             and p.relative_to(root).parts[0].removesuffix(".py") in modules]
    if not files:
        raise ValueError(f"the code task reads the standard library, but {root} holds no held-out .py files")
    return tuple(sorted(str(p.relative_to(root)) for p in files))


def _squash(text: str) -> str:
    """Lines without their indentation, blank lines dropped (the calibration check ignores indentation)."""
    return "\n".join(line.strip() for line in text.splitlines() if line.strip())


@functools.lru_cache(maxsize=None)
def _calibration_code() -> str:
    from ..data.texts import builtin_text

    return _squash(builtin_text("code", "calib"))


def in_calibration(fn: StdlibFunction) -> bool:
    """True when the function's source appears in the calibration text 'code' (indentation ignored)."""
    return _squash(fn.header + "\n" + fn.body) in _calibration_code()


def _defs(tree: ast.AST, prefix: str = ""):
    """(qualified name, node) of every function and method, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = prefix + node.name
            if not isinstance(node, ast.ClassDef):
                yield name, node
            yield from _defs(node, name + ".")
        else:
            yield from _defs(node, prefix)


def _trivial(statements: list[ast.stmt]) -> bool:
    return len(statements) == 1 and (isinstance(statements[0], ast.Pass) or (
        isinstance(statements[0], ast.Expr) and isinstance(statements[0].value, ast.Constant)
        and statements[0].value.value is Ellipsis))


def file_functions(module: str, context_chars: int) -> list[StdlibFunction]:
    """The functions of one file that make items: a docstring ending its line, then 1..MAX_BODY_LINES
    lines of body (not a bare pass or ...); [] for a file that does not parse."""
    try:
        text = (stdlib_folder() / module).read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    lines = text.splitlines()
    out = []
    for name, node in _defs(tree):
        doc, rest = node.body[0], node.body[1:]
        if ast.get_docstring(node, clean=False) is None or not rest or _trivial(rest):
            continue
        if lines[doc.end_lineno - 1][doc.end_col_offset :].strip() or rest[0].lineno <= doc.end_lineno:
            continue  # something follows the docstring on its line
        body = lines[doc.end_lineno : node.end_lineno]
        if not 1 <= len(body) <= MAX_BODY_LINES:
            continue
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        before = "\n".join(lines[: start - 1])
        context = before[-context_chars:] if context_chars else ""
        out.append(StdlibFunction(module, name, start, context + "\n" if context else "",
                                  "\n".join(lines[start - 1 : doc.end_lineno]), "\n".join(body)))
    return out


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def reindent(body: str, like: str) -> str:
    """``body`` moved to the indentation of ``like``'s first line (a distractor in the true body's place)."""
    import textwrap

    pad = _indent(first_line(like))
    return "\n".join(pad + line if line.strip() else "" for line in textwrap.dedent(body).splitlines())


def code_items(settings: CodeSettings) -> list[CodeItem]:
    """``settings.items`` functions, one per file, files ranked by a hash of (``task_seed``, path); each
    with ``choices - 1`` distractor bodies of other files' functions, those of nearest length among a sample."""
    seed = f"code/{settings.task_seed}"
    files = iter(sorted(held_out_files(), key=lambda m: hashlib.sha256(f"{seed}/{m}".encode()).hexdigest()))
    context_chars = CONTEXT_CHARS_PER_TOKEN * settings.context_tokens
    chosen: list[StdlibFunction] = []
    pool: list[StdlibFunction] = []  # every function of the files read: the distractors' bodies

    def read_next() -> bool:
        """Parse the next file into the pool (and draw its item while items are wanted); False at the end."""
        module = next(files, None)
        if module is None:
            return False
        functions = file_functions(module, context_chars)
        pool.extend(functions)
        eligible = [f for f in functions if not in_calibration(f)] if len(chosen) < settings.items else []
        if eligible:
            chosen.append(random.Random(f"{seed}/{module}").choice(eligible))
        return True

    while len(chosen) < settings.items and read_next():
        pass
    if len(chosen) < settings.items:
        raise ValueError(f"items must be at most {len(chosen)}: the standard library holds no more held-out functions")
    items = []
    for fn in chosen:
        while True:  # read on until other files give enough distractors to choose among
            others = [f.body for f in pool if f.module != fn.module and _squash(f.body) != _squash(fn.body)]
            if len(others) >= 8 * settings.choices or not read_next():
                break
        rng = random.Random(f"{seed}/{fn.module}/{fn.name}")
        others = rng.sample(others, min(len(others), 40 * settings.choices))
        others.sort(key=lambda b: abs(len(b) - len(fn.body)))
        bodies = [fn.body] + [reindent(b, fn.body) for b in others[: settings.choices - 1]]
        if len(bodies) < settings.choices:
            raise ValueError(f"choices must be at most {len(bodies)}: too few other functions to draw from")
        order = list(range(len(bodies)))
        rng.shuffle(order)
        items.append(CodeItem(fn, [bodies[k] for k in order], order.index(0)))
    return items


# --- scoring ------------------------------------------------------------------------------------


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_ids(tokenizer, fn: StdlibFunction, context_tokens: int, limit: int | None = None) -> list[int]:
    """The header's tokens after at most ``context_tokens`` of the module text (and within ``limit``)."""
    ids = _encode(tokenizer, fn.context + fn.header)
    keep = len(_encode(tokenizer, fn.header)) + context_tokens
    if limit is not None:
        keep = min(keep, limit)
    return ids[-keep:] if keep > 0 else []


@torch.no_grad()
def score_item(net, tokenizer, item: CodeItem, settings: CodeSettings) -> dict[str, Any]:
    """One item: the candidates' log-likelihoods (candidate_loglik) and the greedy first line."""
    from .passkey import greedy_answerer

    fn = item.function
    targets = [_encode(tokenizer, "\n" + b)[: settings.body_tokens] for b in item.candidates]
    true_head = "\n" + fn.body[: fn.body.index(fn.first_line) + len(fn.first_line)]
    new_tokens = len(_encode(tokenizer, true_head)) + LINE_MARGIN
    limit = getattr(net.config, "max_position_embeddings", None)
    room = None if limit is None else limit - max(max(len(t) for t in targets), new_tokens)
    if room is not None and room < 1:
        raise ValueError(f"body_tokens must leave room for a prompt in the model's context of {limit} tokens")
    prompt = prompt_ids(tokenizer, fn, settings.context_tokens, room)
    ll = candidate_loglik(net, prompt, targets)
    tokens = len(targets[item.answer])
    generated = greedy_answerer(net, tokenizer, new_tokens)(torch.tensor(prompt, dtype=torch.long))
    predicted = first_line(generated)
    out = {"module": fn.module, "function": fn.name, "line": fn.lineno, "prompt_tokens": len(prompt),
           "body_tokens": tokens, "nll_sum": -ll[item.answer], "expected": fn.first_line.strip(),
           "predicted": predicted.strip(), "exact": predicted.strip() == fn.first_line.strip()}
    if len(targets) > 1:
        hit, hit_norm = choice_hits(ll, item.answer, [len(tokenizer.decode(t)) for t in targets])
        out |= {"choice": hit, "choice_norm": hit_norm}
    return out


def score_code(net, tokenizer, items: list[CodeItem], settings: CodeSettings, progress: bool = False,
               label: str = TASK) -> dict[str, Any]:
    """(a) nll per body token (and its exp), (b) exact_match, (c) acc and acc_norm with choices > 1."""
    from ..progress import progress_bar

    rows = [score_item(net, tokenizer, item, settings) for item in progress_bar(items, label, enabled=progress)]
    tokens = sum(r["body_tokens"] for r in rows)
    nll = sum(r["nll_sum"] for r in rows) / tokens
    out: dict[str, Any] = {"items": len(rows), "tokens": tokens, "nll": nll, "perplexity": math.exp(nll),
                           "exact_match": sum(r["exact"] for r in rows) / len(rows)}
    if settings.choices > 1:
        out |= {"acc": sum(r["choice"] for r in rows) / len(rows),
                "acc_norm": sum(r["choice_norm"] for r in rows) / len(rows), "chance": 1 / settings.choices}
    return out | {"functions": rows}


def evaluate_code(spec: str, settings: CodeSettings, dtype: torch.dtype = torch.float32, device: str = "cpu",
                  role: str = "model", progress: bool = True) -> dict[str, Any]:
    """Load ``spec`` and score the code items on it."""
    import platform

    from ..checkpoint.resolve import load_model

    items = code_items(settings)  # before the model loads: a bad setting fails fast
    net, tokenizer = load_model(str(spec), dtype=dtype, device=device)
    try:
        start = time.perf_counter()
        result = score_code(net, tokenizer, items, settings, progress=progress, label=f"{TASK} {role}")
        return {"model": str(spec), "role": role, "task": TASK, "python": platform.python_version(), **result,
                "seconds": round(time.perf_counter() - start, 1)}
    finally:
        del net
        gc.collect()


__all__ = ["CodeItem", "CodeSettings", "StdlibFunction", "TASK", "code_items", "evaluate_code", "file_functions",
           "first_line", "held_out_files", "in_calibration", "prompt_ids", "reindent", "score_code", "score_item"]
