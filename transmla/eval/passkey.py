"""Passkey retrieval (issue 34): can the model find a 5-digit key stated once, far back in real prose?

A prompt of exactly ``length`` tokens: an instruction, filler text (the evaluation parts of the
built-in ``wiki`` and ``lee`` texts, starting at a paragraph drawn per key, so every key sits in
different prose), the needle ``The pass key is 41729. Remember it. 41729 is the pass key.`` placed so
it starts at ``depth`` percent of the prompt (moved to the nearest sentence end within a few tokens),
more filler, and the question ``What is the pass key? The pass key is``. The model answers greedily
through its own cache (``generate``: for MLA models the latent cache and the CPU kernels); a key
counts as found when the decoded continuation contains it. Cells are (length, depth); each holds
``keys`` prompts whose keys and filler are drawn from fixed seeds, so source and converted models
see the same text.

Nothing here parses flags or prints results: ``transmla eval --task passkey`` (cli/evaluate.py) and
benchmarks/passkey.py call ``evaluate_passkey`` and the report writers.
"""

from __future__ import annotations

import gc
import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..schema import option

__all__ = [
    "PasskeyPrompt",
    "PasskeySettings",
    "build_prompt",
    "default_lengths",
    "evaluate_passkey",
    "filler_paragraphs",
    "found",
    "greedy_answerer",
    "parse_depths",
    "parse_lengths",
    "passkey_lengths",
    "passkey_markdown",
    "plot_passkey",
    "run_passkey",
    "write_passkey_report",
]

INSTRUCTION = ("There is an important piece of information hidden inside a lot of irrelevant text. "
               "Find it and memorize it. I will quiz you about it.\n\n")
NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\n\nWhat is the pass key? The pass key is"
DEFAULT_LENGTHS = (1024, 2048, 4096, 8192)
SNAP_TOKENS = 24  # the needle moves at most this many tokens (and 2% of the prompt) to start a sentence
_SENTENCE_END = re.compile(r"[.!?:;\n][\"')\]]*\s*$")


def parse_lengths(text: str) -> list[int]:
    """'1K,2K,4096' -> [1024, 2048, 4096] (K = 1024), each positive."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        m = re.fullmatch(r"(\d+)\s*([kK]?)", part)
        if not m:
            raise ValueError(f"lengths must be token counts like 1K,2K,4096, got {part!r}")
        n = int(m.group(1)) * (1024 if m.group(2) else 1)
        if n < 1:
            raise ValueError(f"lengths must be positive, got {part!r}")
        out.append(n)
    return sorted(set(out))


def parse_depths(text: str) -> list[float]:
    """'10,50,90' -> [10.0, 50.0, 90.0], each strictly between 0 and 100 (percent of the prompt)."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        try:
            d = float(part)
        except ValueError:
            raise ValueError(f"depths must be percentages like 10,50,90, got {part!r}") from None
        if not 0 < d < 100:
            raise ValueError(f"depths must lie strictly between 0 and 100 (percent of the prompt), got {part}")
        out.append(d)
    return sorted(set(out))


@dataclass
class PasskeySettings:
    """The passkey protocol (flags of `transmla eval --task passkey`)."""

    lengths: str | None = option(None, "Passkey: prompt lengths in tokens, comma-separated, K = 1024 "
                                 "(default: 1K,2K,4K,8K up to the model's max_position_embeddings).")
    depths: str = option("10,50,90", "Passkey: where the key starts, percent of the prompt, comma-separated, "
                         "each in (0, 100).")
    keys: int = option(3, "Passkey: keys (prompts) per length x depth cell.")
    seed: int = option(0, "Passkey: seed of the keys and of where each key's filler starts.")
    filler: str = option("wiki,lee", "Passkey: filler text, comma-separated: built-in names (their evaluation "
                         "parts) or .txt files.")
    answer_tokens: int = option(8, "Passkey: tokens generated (greedy) for the answer.")
    depth_list: list[float] = field(default_factory=list, repr=False)
    length_list: list[int] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        """Checked before any model loads (one-line errors naming the setting)."""
        self.depth_list = parse_depths(self.depths)
        self.length_list = parse_lengths(self.lengths) if self.lengths is not None else None
        if self.keys < 1:
            raise ValueError(f"keys must be at least 1, got {self.keys}")
        if self.answer_tokens < 1:
            raise ValueError(f"answer_tokens must be at least 1, got {self.answer_tokens}")
        if not self.filler.strip():
            raise ValueError("filler must name at least one text")

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k not in ("depth_list", "length_list")}


def default_lengths(max_positions: int | None) -> list[int]:
    """1K, 2K, 4K, 8K up to min(8K, max_positions); the context itself when it is under 1K."""
    limit = min(DEFAULT_LENGTHS[-1], max_positions or DEFAULT_LENGTHS[-1])
    return [n for n in DEFAULT_LENGTHS if n <= limit] or [limit]


def filler_paragraphs(spec: str) -> list[str]:
    """The filler's paragraphs (non-empty lines), in order, of every text named in ``spec``."""
    from ..data.texts import BUILTIN_TEXTS, load_text

    paragraphs: list[str] = []
    for name in (s.strip() for s in spec.split(",") if s.strip()):
        if name not in BUILTIN_TEXTS and not Path(name).is_file():
            raise ValueError(f"filler {name!r} is neither a built-in text ({', '.join(BUILTIN_TEXTS)}) nor a file")
        text = load_text(name, part="eval")
        paragraphs += [" ".join(line.split()) for line in text.splitlines() if line.strip()]
    if not paragraphs:
        raise ValueError(f"filler {spec!r} holds no text")
    return paragraphs


@dataclass
class PasskeyPrompt:
    ids: torch.Tensor  # [length] token ids
    key: str
    depth: float  # asked, percent
    needle_start: int  # token index where the needle begins
    needle_tokens: int
    start_paragraph: int  # where the filler begins

    @property
    def actual_depth(self) -> float:
        return 100.0 * self.needle_start / self.ids.numel()


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _filler_ids(tokenizer, paragraphs: Sequence[str], start: int, need: int) -> list[int]:
    """At least ``need`` tokens of filler from paragraph ``start`` on (wrapping around)."""
    chars, text = max(256, 6 * need), ""
    while True:
        parts, size, i = [], 0, start
        while size < chars:
            p = paragraphs[i % len(paragraphs)]
            parts.append(p)
            size += len(p) + 1
            i += 1
        text = "\n".join(parts)
        ids = _encode(tokenizer, text)
        if len(ids) >= need:
            return ids
        if size > 64 * need + 100_000:  # the tokenizer maps text to (almost) nothing
            raise ValueError(f"the filler gives only {len(ids)} tokens in {size:,} characters; {need} are needed")
        chars *= 2


def _snap(tokenizer, filler: list[int], cut: int, window: int, lo: int, hi: int) -> int:
    """The cut nearest ``cut`` (within ``window``, inside [lo, hi]) right after a sentence end."""
    for delta in range(window + 1):
        for j in (cut - delta, cut + delta):
            if lo < j <= hi and _SENTENCE_END.search(tokenizer.decode(filler[max(0, j - 2) : j])):
                return j
    return cut


def build_prompt(tokenizer, paragraphs: Sequence[str], length: int, depth: float, key: str,
                 start_paragraph: int = 0) -> PasskeyPrompt:
    """The prompt of exactly ``length`` tokens with the needle for ``key`` starting near ``depth`` percent."""
    head = _encode(tokenizer, INSTRUCTION)
    needle = _encode(tokenizer, NEEDLE.format(key=key))
    question = _encode(tokenizer, QUESTION)
    n_filler = length - len(head) - len(needle) - len(question)
    if n_filler < 2:
        raise ValueError(f"lengths must be at least {length - n_filler + 2} tokens for a passkey prompt, got {length}")
    filler = _filler_ids(tokenizer, paragraphs, start_paragraph, n_filler)[:n_filler]
    cut = min(max(round(depth / 100 * length) - len(head), 0), n_filler)
    window = min(SNAP_TOKENS, length // 50)
    cut = _snap(tokenizer, filler, cut, window, 0, n_filler)
    ids = head + filler[:cut] + needle + filler[cut:] + question
    return PasskeyPrompt(torch.tensor(ids, dtype=torch.long), key, depth, len(head) + cut, len(needle), start_paragraph)


def found(continuation: str, key: str) -> bool:
    """The answer counts when the greedy continuation holds the key."""
    return key in continuation


@dataclass
class Trial:
    length: int
    depth: float
    key: str
    start_paragraph: int


def trials(lengths: Sequence[int], depths: Sequence[float], keys: int, seed: int, paragraphs: int) -> list[Trial]:
    """Every cell's keys and filler starts, from fixed seeds (one generator per cell and key index)."""
    out = []
    for length in lengths:
        for depth in depths:
            for i in range(keys):
                rng = random.Random(f"passkey/{seed}/{length}/{depth:g}/{i}")
                out.append(Trial(length, depth, str(rng.randint(10000, 99999)), rng.randrange(paragraphs)))
    return out


Answerer = Callable[[torch.Tensor], str]  # prompt ids [L] -> the decoded continuation


def greedy_answerer(net, tokenizer, new_tokens: int) -> Answerer:
    """Greedy decoding through the model's own cache (``generate``: the latent cache for MLA models)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def answer(ids: torch.Tensor) -> str:
        x = ids[None].to(net.device)  # [1, L]
        with torch.inference_mode():
            out = net.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                               do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=pad)
        return tokenizer.decode(out[0, x.shape[1] :], skip_special_tokens=True)

    return answer


def run_passkey(answer: Answerer, tokenizer, settings: PasskeySettings, lengths: Sequence[int],
                progress: bool = True, label: str = "passkey") -> dict[str, Any]:
    """Every cell of lengths x depths, ``settings.keys`` prompts each; the per-cell results and timings."""
    from ..progress import progress_bar

    paragraphs = filler_paragraphs(settings.filler)
    plan = trials(lengths, settings.depth_list, settings.keys, settings.seed, len(paragraphs))
    cells: dict[tuple[int, float], dict[str, Any]] = {}
    for t in progress_bar(plan, label, enabled=progress, size=lambda t: t.length, total=sum(t.length for t in plan)):
        prompt = build_prompt(tokenizer, paragraphs, t.length, t.depth, t.key, t.start_paragraph)
        start = time.perf_counter()
        text = answer(prompt.ids)
        seconds = time.perf_counter() - start
        cell = cells.setdefault((t.length, t.depth), {"length": t.length, "depth": t.depth, "found": 0,
                                                      "trials": [], "seconds": 0.0})
        hit = found(text, t.key)
        cell["found"] += int(hit)
        cell["seconds"] += seconds
        cell["trials"].append({"key": t.key, "answer": text, "found": hit, "needle_depth": round(prompt.actual_depth, 2),
                               "start_paragraph": t.start_paragraph, "seconds": round(seconds, 3)})
    rows = []
    for cell in cells.values():
        n = len(cell["trials"])
        rows.append(cell | {"keys": n, "accuracy": cell["found"] / n, "seconds": round(cell["seconds"], 2)})
    total = sum(r["found"] for r in rows)
    keys = sum(r["keys"] for r in rows)
    return {"cells": rows, "found": total, "keys": keys, "accuracy": total / keys if keys else 0.0,
            "seconds": round(sum(r["seconds"] for r in rows), 2)}


def passkey_lengths(spec: str | Path, settings: PasskeySettings) -> list[int]:
    """The prompt lengths for ``spec`` (its config only, no weights): the asked ones, refused past its
    context, or the defaults up to it."""
    from ..checkpoint.resolve import load_config

    limit = getattr(load_config(str(spec)), "max_position_embeddings", None)
    if settings.length_list is None:
        return default_lengths(limit)
    if limit is not None and max(settings.length_list) > limit:
        raise ValueError(f"lengths must fit {spec}'s context of {limit} tokens (max_position_embeddings), "
                         f"got {max(settings.length_list)}")
    return settings.length_list


def evaluate_passkey(spec: str | Path, settings: PasskeySettings, dtype: torch.dtype = torch.float32,
                     device: str = "cpu", role: str = "model", progress: bool = True,
                     lengths: Sequence[int] | None = None) -> dict[str, Any]:
    """Load ``spec`` and run the passkey cells on it (``lengths``: default ``passkey_lengths``)."""
    from ..checkpoint.resolve import load_model

    lengths = list(lengths) if lengths is not None else passkey_lengths(spec, settings)
    net, tokenizer = load_model(str(spec), dtype=dtype, device=device)
    try:
        result = run_passkey(greedy_answerer(net, tokenizer, settings.answer_tokens), tokenizer, settings, lengths,
                             progress=progress, label=f"passkey {role}")
        attention = "MLA" if getattr(net.config, "mla", None) is not None else "MHA/GQA"
        return {"model": str(spec), "role": role, "attention": attention,
                "context": getattr(net.config, "max_position_embeddings", None), "lengths": lengths,
                "depths": settings.depth_list, **result}
    finally:
        del net
        gc.collect()


# --- report -----------------------------------------------------------------------------------


def _grid(entry: dict[str, Any]) -> tuple[list[int], list[float], dict[tuple[int, float], dict]]:
    cells = {(c["length"], c["depth"]): c for c in entry["cells"]}
    return sorted({c["length"] for c in entry["cells"]}), sorted({c["depth"] for c in entry["cells"]}), cells


def _length_label(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def passkey_rows(entries: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """One row per (length, depth): found/keys per model, and the seconds each cell took."""
    lengths = sorted({c["length"] for e in entries for c in e["cells"]})
    depths = sorted({c["depth"] for e in entries for c in e["cells"]})
    header = ["length", "depth"] + [f"{e['role']} found" for e in entries] + [f"{e['role']} s" for e in entries]
    grids = [_grid(e)[2] for e in entries]
    rows = []
    for n in lengths:
        for d in depths:
            got = [g.get((n, d)) for g in grids]
            rows.append([_length_label(n), f"{d:g}%"]
                        + [f"{c['found']}/{c['keys']}" if c else "" for c in got]
                        + [f"{c['seconds']:.1f}" if c else "" for c in got])
    common = set.intersection(*(set(g) for g in grids))  # totals over the cells every model has
    totals = [[g[k] for k in common] for g in grids]
    found, keys = [sum(c["found"] for c in t) for t in totals], [sum(c["keys"] for c in t) for t in totals]
    rows.append(["all" if all(len(g) == len(common) for g in grids) else "common cells", ""]
                + [f"{f}/{k} ({f / k:.0%})" if k else "" for f, k in zip(found, keys)]
                + [f"{sum(c['seconds'] for c in t):.0f}" for t in totals])
    return header, rows


def passkey_markdown(report: dict[str, Any], plot: str | None = None) -> str:
    from .formatting import md_table

    entries = report["models"]
    s = report["settings"]
    header, rows = passkey_rows(entries)
    parts = [
        "# Passkey retrieval: " + " vs ".join(e["model"] for e in entries),
        "",
        f"A 5-digit key stated once (\"{NEEDLE.strip().format(key='41729')}\") inside filler text ({s['filler']}, "
        f"evaluation parts, a different starting paragraph per key) at each depth of prompts of each length, asked for "
        f"at the end (\"{QUESTION.strip()}\"); found = the greedy continuation ({s['answer_tokens']} tokens, through "
        f"the model's own cache) holds the key. {s['keys']} keys per cell, seed {s['seed']}. Seconds: wall time of "
        "the cell's prefills and answers.",
        "",
        md_table(header, rows),
        "",
    ]
    if plot:
        parts += [f"![passkey]({Path(plot).name})", ""]
    env = report.get("environment")
    if env:
        parts += [f"Machine: {env['machine']}, load {env['load_average']}; Python {env['python']}, torch {env['torch']}, "
                  f"transformers {env['transformers']}; {env['date']}.", ""]
    return "\n".join(parts)


def plot_passkey(entries: Sequence[dict[str, Any]], path: Path) -> Path:
    """Heatmaps of accuracy, depth (rows) x length (columns), one panel per model, like the needle plots."""
    from .plots import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, len(entries), figsize=(3.2 + 2.6 * len(entries), 3.4), dpi=120, squeeze=False,
                             layout="constrained")
    image = None
    for ax, entry in zip(axes[0], entries):
        lengths, depths, cells = _grid(entry)
        grid = [[cells[(n, d)]["accuracy"] if (n, d) in cells else float("nan") for n in lengths] for d in depths]
        image = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
        ax.set_xticks(range(len(lengths)), [_length_label(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:g}%" for d in depths])
        for i, d in enumerate(depths):
            for j, n in enumerate(lengths):
                c = cells.get((n, d))
                if c:
                    ax.text(j, i, f"{c['found']}/{c['keys']}", ha="center", va="center", fontsize=9)
        ax.set_xlabel("prompt length (tokens)")
        ax.set_title(f"{entry['role']}: {Path(str(entry['model'])).name}\n{entry['found']}/{entry['keys']} found",
                     fontsize=8)
    axes[0][0].set_ylabel("key depth")
    fig.colorbar(image, ax=list(axes[0]), fraction=0.05, label="accuracy")
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def write_passkey_report(report: dict[str, Any], out_dir: str | Path, stem: str = "passkey") -> dict[str, Path]:
    """{stem}.json, {stem}.md and {stem}.png (the heatmaps) in out_dir (created)."""
    from ..checkpoint.files import refuse_symlinks
    from .report import write_json

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    refuse_symlinks(out_dir)
    png = plot_passkey(report["models"], out_dir / f"{stem}.png")
    files = {"json": write_json(report, out_dir / f"{stem}.json"), "png": png}
    md = out_dir / f"{stem}.md"
    md.write_text(passkey_markdown(report, str(png)))
    files["md"] = md
    return files
