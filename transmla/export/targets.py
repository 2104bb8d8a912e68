"""Export targets by name: what `transmla export --format NAME` writes, and the one place a target
is registered (docs/USAGE.md, "Adding an engine export target").

A target is a name, its part of --format's help, and `write(model, output, settings)`: `model` the
command's MODEL argument (resolved by the target after its own settings are checked), `settings`
every export flag by field name (ExportOptions' fields, weight_type, tokenizer_pre, plain_query); it returns
the summary `transmla export` prints (a table, or JSON with --json).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ..checkpoint.resolve import resolve_model_dir
from .options import ExportOptions


@dataclass(frozen=True)
class ExportTarget:
    name: str  # the --format value
    help: str  # its part of --format's help
    write: Callable[[str, Path, dict[str, Any]], dict[str, Any]]


def _write_deepseek(model: str, output: Path, settings: dict[str, Any]) -> dict[str, Any]:
    from .deepseek import export_deepseek

    options = ExportOptions(**{f.name: settings[f.name] for f in fields(ExportOptions)})
    options.refuse_fp16()
    result = export_deepseek(resolve_model_dir(model), output, options)
    record = result.record
    return {
        "output": result.output,
        "format": result.format,
        "kv_elements_per_token_per_layer": result.kv_elements_per_token_per_layer,
        "padded_latent": record["padded_latent"],
        "padded_value": record["padded_value"],
        "dropped_biases": record["dropped_biases"],
        "rms_norm_eps": f"{record['source_rms_norm_eps']} -> 1e-06" if record["rms_norm_eps_changed"] else "1e-06",
        **{f"loads in {e}": "yes" if why is None else f"no: {why}" for e, why in result.engines.items()},
        "files": len(result.files),
    }


def _gguf_writer(engine_name: str, format_name: str) -> Callable[[str, Path, dict[str, Any]], dict[str, Any]]:
    """A GGUF target for one llama.cpp (export/gguf.py's MAINLINE or IK conventions). Of the export
    settings only drop_biases, pad_value, plain_query (ik: IK_PLAIN_QUERY) and force apply to a GGUF file."""

    def write(model: str, output: Path, settings: dict[str, Any]) -> dict[str, Any]:
        from .gguf import ENGINES, IK_PLAIN_QUERY, export_gguf

        engine = IK_PLAIN_QUERY if settings.get("plain_query") else ENGINES[engine_name]  # write_export allows it for gguf-ik only
        drop_biases = settings["drop_biases"]
        gguf = export_gguf(resolve_model_dir(model), output, settings["weight_type"], settings["tokenizer_pre"],
                           drop_biases=drop_biases, pad_value=settings["pad_value"], force=settings["force"],
                           engine=engine)
        return {"output": str(gguf.path), "format": format_name, "type": gguf.weight_type,
                "tokenizer_pre": gguf.tokenizer_pre, "kv_elements_per_token_per_layer": gguf.cache_elements,
                "tensors": gguf.tensors, "bytes": gguf.bytes, "dropped_biases": drop_biases,
                "padded_value": settings["pad_value"], "engine": gguf.engine}

    return write


TARGETS: dict[str, ExportTarget] = {t.name: t for t in (
    ExportTarget("deepseek", "a stock DeepseekV3ForCausalLM folder (transformers, vLLM, SGLang)", _write_deepseek),
    ExportTarget("gguf", "a llama.cpp `deepseek2` GGUF file (llama.cpp, Ollama)",
                 _gguf_writer("llama.cpp", "gguf (llama.cpp deepseek2)")),
    ExportTarget("gguf-ik", "an ik_llama.cpp `deepseek2` GGUF file (its MLA modes -mla 1/2/3, flash MLA)",
                 _gguf_writer("ik_llama.cpp", "gguf-ik (ik_llama.cpp deepseek2)")),
)}


def formats_help() -> str:
    return "; ".join(f"{t.name}: {t.help}" for t in TARGETS.values()) + "."


# Flags of one format only: (flag, settings key, its value when not given, the format, why another refuses it)
FORMAT_ONLY_FLAGS = (
    ("--plain-query", "plain_query", False, "gguf-ik", "keeps the query as it is"),
    # the DeepSeek folder's engine settings; a GGUF file is its own engine's
    ("--engines", "engines", "transformers", "deepseek", "writes one engine's file"),
    ("--pad-latent", "pad_latent", False, "deepseek", "writes one engine's file"),
    ("--pad-width", "pad_width", None, "deepseek", "writes one engine's file"),
)


def write_export(format: str, model: str, output: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """Export `model` to `output` as the target `format` writes it; its summary."""
    if format not in TARGETS:
        raise ValueError(f"format must be one of {', '.join(TARGETS)}, got {format!r}")
    from .errors import ExportError

    for flag, key, unset, only, why in FORMAT_ONLY_FLAGS:
        if format != only and settings.get(key, unset) != unset:
            raise ExportError(f"{flag} applies to --format {only} only ({format} {why})")
    return TARGETS[format].write(model, output, settings)


__all__ = ["ExportTarget", "TARGETS", "formats_help", "write_export"]
