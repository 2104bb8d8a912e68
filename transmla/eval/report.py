"""The comparison report (``transmla eval MODEL --compare SOURCE --report DIR``): report.json,
report.md and its plots. One entry per model (perplexity, KV elements and bytes per token per layer
and for the whole model at a context, the cache measured after generating tokens), the change
against the source, the protocol; and the facts every report records (the protocol, the command
line). A sweep's Markdown is sweep_report.py, the plots plots.py, number formats formatting.py.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from .formatting import format_bytes, format_ppl, md_table
from .plots import plot_compare

if TYPE_CHECKING:  # annotations only: the report module imports no torch
    from .kv import KVSummary
    from .measured_cache import MeasuredCache
    from .perplexity import PerplexityResult

__all__ = [
    "ModelEntry",
    "command_line",
    "compare_rows",
    "model_entry",
    "protocol_info",
    "render_compare_markdown",
    "write_compare_report",
    "write_json",
]


# --- facts ----------------------------------------------------------------------------------


def protocol_info(result: PerplexityResult, data: str, text_field: str = "text") -> dict[str, Any]:
    """The evaluation protocol of a perplexity result, named and described."""
    name = result.protocol
    L, n, tokens = result.seq_len, result.windows, result.tokens
    if name == "sliding":
        text = (
            f"token-level perplexity exp(mean NLL), sliding window (Hugging Face guide): a {L}-token context "
            f"moved by stride {result.stride} in {n} steps, each token scored once ({tokens:,} scored tokens), "
            f"no special tokens added"
        )
    else:
        text = (
            f"token-level perplexity exp(mean NLL) over the first {n} non-overlapping {L}-token windows "
            f"({tokens:,} scored tokens: every token but the first of each window), no special tokens added"
        )
    return {
        "name": name,
        "seq_len": L,
        "stride": result.stride,
        "windows": n,
        "tokens": tokens,
        "data": data,
        "text_field": text_field,
        "description": f"{text}; text: {describe_data(data)}",
    }


def describe_data(data: str) -> str:
    if data in ("wiki", "lee"):
        return f"{data!r}, the built-in evaluation part (last 20% of the characters, never used for calibration)"
    if data == "code":
        return "'code', the built-in evaluation part (standard-library modules n..z, never used for calibration)"
    return repr(data)


@dataclass
class ModelEntry:
    """One model's line of a report; a dict (to_dict, the key order of report.json) only when written."""

    model: str
    role: str
    attention: str
    method: str | None
    layers: int
    perplexity: float
    nll: float
    tokens: int
    windows: int
    cache_dtype: str
    kv_elements_per_token_per_layer: int
    kv_bytes_per_token_per_layer: int
    kv_bytes_per_token: int
    context: int | None
    kv_bytes_at_context: int | None
    # MLA / source geometry: written only when known
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    measured_cache: MeasuredCache | None = None
    eval_seconds: float | None = None
    eval_cpu_seconds: float | None = None  # all threads of the process; written only when measured

    OPTIONAL: ClassVar[tuple[str, ...]] = ("kv_lora_rank", "qk_rope_head_dim", "kv_heads", "head_dim", "eval_cpu_seconds")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name in self.OPTIONAL:
                continue
            out[f.name] = value.to_dict() if f.name == "measured_cache" and value is not None else value
        return out


def model_entry(
    spec: str,
    role: str,
    kv: KVSummary,
    ppl: PerplexityResult,
    measured: MeasuredCache | None = None,
    eval_seconds: float | None = None,
) -> ModelEntry:
    """One model's line of a report: perplexity, KV accounting (``kv_summary(config, dtype, context)``)
    and, if measured, the cache after generation."""
    kv = kv.to_dict()
    return ModelEntry(
        model=spec,
        role=role,
        attention=kv["attention"],
        method=kv.get("method"),
        layers=kv["layers"],
        perplexity=ppl.perplexity,
        nll=ppl.nll,
        tokens=ppl.tokens,
        windows=ppl.windows,
        cache_dtype=kv["cache_dtype"],
        kv_elements_per_token_per_layer=kv["kv_elements_per_token_per_layer"],
        kv_bytes_per_token_per_layer=kv["kv_bytes_per_token_per_layer"],
        kv_bytes_per_token=kv["kv_bytes_per_token"],
        context=kv.get("context"),
        kv_bytes_at_context=kv.get("kv_bytes_at_context"),
        **{key: kv.get(key) for key in ("kv_lora_rank", "qk_rope_head_dim", "kv_heads", "head_dim")},
        measured_cache=measured,
        eval_seconds=eval_seconds,
    )


def comparison(model: Mapping[str, Any], source: Mapping[str, Any]) -> dict[str, Any]:
    """Change of the model against the source (same protocol, same tokens)."""
    if model["tokens"] != source["tokens"]:
        raise ValueError(
            f"the two models scored different token counts ({model['tokens']} vs {source['tokens']}): "
            "they need the same tokenizer and protocol to be compared"
        )
    delta = model["perplexity"] - source["perplexity"]
    out = {
        "perplexity_change": delta,
        "perplexity_change_pct": 100.0 * delta / source["perplexity"],
        "nll_change": model["nll"] - source["nll"],
        "cache_ratio": model["kv_elements_per_token_per_layer"] / source["kv_elements_per_token_per_layer"],
        "cache_bytes_ratio": model["kv_bytes_per_token"] / source["kv_bytes_per_token"],
    }
    if model.get("kv_bytes_at_context") is not None and source.get("kv_bytes_at_context") is not None:
        out["kv_bytes_saved_at_context"] = source["kv_bytes_at_context"] - model["kv_bytes_at_context"]
    mm, sm = model.get("measured_cache"), source.get("measured_cache")
    if mm and sm:
        out["measured_cache_ratio"] = mm["measured_bytes_per_token_per_layer"] / sm["measured_bytes_per_token_per_layer"]
    return out


# --- formatting -----------------------------------------------------------------------------


def _label(entry: Mapping[str, Any]) -> str:
    method = entry.get("method")
    kind = entry["attention"] + (f", {method}" if method else "")
    return f"{entry['role']} ({kind})"


def compare_rows(report: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The comparison table as a header and rows of strings (used by the CLI and report.md)."""
    models = report["models"]
    cmp = report.get("comparison")
    header = ["", *(_label(m) for m in models)] + (["change"] if cmp else [])
    context = report.get("context")
    rows: list[list[str]] = []

    def row(name: str, values: Sequence[str], change: str = "") -> None:
        rows.append([name, *values] + ([change] if cmp else []))

    row("model", [str(m["model"]) for m in models])
    change = f"{cmp['perplexity_change']:+,.2f} ({cmp['perplexity_change_pct']:+.1f}%)" if cmp else ""
    row("perplexity", [format_ppl(m["perplexity"]) for m in models], change)
    row("tokens evaluated", [f"{m['tokens']:,}" for m in models])
    row("KV elements / token / layer", [str(m["kv_elements_per_token_per_layer"]) for m in models],
        f"x{cmp['cache_ratio']:.4g}" if cmp else "")
    row("KV bytes / token / layer", [f"{m['kv_bytes_per_token_per_layer']:,} ({m['cache_dtype']})" for m in models])
    row("KV bytes / token (all layers)", [f"{m['kv_bytes_per_token']:,} ({m['layers']} layers)" for m in models])
    if context:
        saved = cmp.get("kv_bytes_saved_at_context") if cmp else None
        row(f"KV cache at {context:,} tokens", [format_bytes(m.get("kv_bytes_at_context")) for m in models],
            "" if not saved else (f"-{format_bytes(saved)}" if saved > 0 else f"+{format_bytes(-saved)}"))
    if any(m.get("measured_cache") for m in models):
        def measured(m):
            mc = m.get("measured_cache")
            if not mc:
                return "–"
            ok = "= formula" if mc["matches_formula"] else f"formula {mc['formula_bytes']:,}"
            return f"{mc['measured_bytes']:,} B for {mc['cached_tokens']} tokens ({ok})"

        row("measured cache after generation", [measured(m) for m in models],
            f"x{cmp['measured_cache_ratio']:.4g}" if cmp and "measured_cache_ratio" in cmp else "")
    if cmp:
        row("cache ratio (model / source)", ["" for _ in models[:-1]] + [f"{cmp['cache_ratio']:.4g}"])
    return header, rows


def render_compare_markdown(report: Mapping[str, Any], plots: Sequence[str] = ()) -> str:
    models = report["models"]
    env = report["environment"]
    title = "Evaluation: " + " vs ".join(str(m["model"]) for m in models)
    header, rows = compare_rows(report)
    parts = [
        f"# {title}",
        "",
        f"**Protocol** ({report['protocol']['name']}): {report['protocol']['description']}.",
        "",
        md_table(header, rows),
        "",
    ]
    cmp = report.get("comparison")
    if cmp:
        parts += [
            f"The converted model keeps {cmp['cache_ratio']:.1%} of the source's KV cache per token and changes "
            f"perplexity by {cmp['perplexity_change']:+,.2f} ({cmp['perplexity_change_pct']:+.1f}%).",
            "",
        ]
    if any(m.get("measured_cache") for m in models):
        parts += [
            "Measured cache: a prompt is prefilled and tokens are generated greedily one at a time through the "
            "model's own cache; the bytes every layer's cache tensors hold are counted and set beside "
            "`elements per token per layer x layers x cached tokens x bytes per element`.",
            "",
        ]
    for p in plots:
        parts += [f"![{Path(p).stem}]({Path(p).name})", ""]
    parts += [
        f"Machine: {env['machine']}" + (f", GPU {env['gpu']}" if env.get("gpu") else "")
        + f"; Python {env['python']}, torch {env['torch']}, transformers {env['transformers']}; {env['date']}.",
        "",
    ]
    return "\n".join(parts)


# --- files ----------------------------------------------------------------------------------


def write_json(data: Any, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return path


def write_compare_report(report: Mapping[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """report.json, report.md, perplexity.png, kv_cache.png in out_dir (created)."""
    from ..checkpoint.files import refuse_symlinks

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    refuse_symlinks(out_dir)
    plots = plot_compare(report, out_dir)
    files = {"json": write_json(report, out_dir / "report.json")}
    md = out_dir / "report.md"
    md.write_text(render_compare_markdown(report, [str(p) for p in plots]))
    files["md"] = md
    for p in plots:
        files[p.stem] = p
    return files


def command_line() -> str:
    """The command as the user typed it (best effort)."""
    argv = list(sys.argv)
    if argv and argv[0].endswith(("transmla", "app.py", "__main__.py")):
        argv[0] = "transmla"
    import shlex

    return " ".join(shlex.quote(a) for a in argv)
