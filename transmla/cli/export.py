"""transmla export: a converted model written for other engines (DeepSeek-V3 folder, llama.cpp / ik_llama.cpp GGUF).

The formats are the export targets (export/targets.py); the export settings' flags are derived from
ExportOptions (export/options.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..export.gguf import GGUF_TYPES
from ..export.options import ExportOptions
from ..export.targets import formats_help, write_export
from .common import JsonFlag, emit
from .options import schema_flags, with_flags

Opt = typer.Option


def export(
    model: Annotated[str, typer.Argument(help="A converted (native MLA) model folder.")],
    output: Annotated[Path, typer.Argument(help="Output folder, or the .gguf file for --format gguf / gguf-ik (written atomically; must not exist unless --force).")],
    format: Annotated[str, Opt("--format", help=formats_help())] = "deepseek",
    gguf_type: Annotated[str, Opt("--type", help=f"gguf, gguf-ik: weight type, {' | '.join(GGUF_TYPES)} (norms stay f32; the scaled latent rows never q8_0).")] = "f32",
    tokenizer_pre: Annotated[str | None, Opt("--tokenizer-pre", help="gguf, gguf-ik: llama.cpp's pre-tokenizer name (tokenizer.ggml.pre), when it cannot be read from tokenizer.json.")] = None,
    plain_query: Annotated[bool, Opt("--plain-query", help="gguf-ik: the query as one plain attn_q matrix, for ik_llama.cpp built with tools/ik_llama_cpp/plain-query.patch (`make ik-llama-cpp-patched`; stock ik loads a plain query only for 26/27-layer models and refuses the file). Without it a full-rank q_a + q_b path is written: exact, one hidden x hidden matrix more per layer read every step.")] = False,
    *,
    as_json: JsonFlag = False,
    settings: dict,
) -> None:
    """Export a converted model so stock engines run it without this package (no remote code)."""
    summary = write_export(format, model, output, {**settings, "weight_type": gguf_type, "tokenizer_pre": tokenizer_pre,
                                                    "plain_query": plain_query})
    emit(summary, as_json, "exported")


export = with_flags(export, schema_flags(ExportOptions))
