"""The transmla command line. Commands live in one module each; this file wires them up.

Errors print as one line on stderr with exit code 1; set TRANSMLA_DEBUG=1 for the traceback.
"""

from __future__ import annotations

import os
import sys
import warnings

import typer

from .convert import convert
from .evaluate import evaluate
from .generate import generate
from .inspect import inspect

app = typer.Typer(
    name="transmla",
    help="Convert MHA/GQA Hugging Face checkpoints (Llama, Qwen2, Mistral, Mixtral) into Multi-head Latent "
    "Attention, evaluate them (perplexity, KV-cache size, decode speed) and fine-tune them briefly.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.command()(convert)
app.command()(inspect)
app.command("eval")(evaluate)
app.command()(generate)


def _register_optional() -> None:
    """Commands whose modules may be absent from a partial install (bench needs triton for its kernel)."""
    import importlib

    for module, attr, name in (("bench", "bench_app", "bench"), ("sweep", "sweep", "sweep"), ("finetune", "finetune", "finetune")):
        try:
            obj = getattr(importlib.import_module(f"{__package__}.{module}"), attr)
        except (ImportError, AttributeError):
            continue
        if isinstance(obj, typer.Typer):
            app.add_typer(obj, name=name)
        else:
            app.command(name)(obj)


_register_optional()


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code (console scripts pass it to sys.exit)."""
    _quiet_libraries()
    import click

    try:
        code = app(args=argv, standalone_mode=False)  # a command's typer.Exit(n) comes back as n
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.ClickException as e:  # usage errors: click's own message
        e.show()
        return e.exit_code
    except click.exceptions.Abort:
        print("error: aborted", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # one line for users; the traceback behind TRANSMLA_DEBUG
        if os.environ.get("TRANSMLA_DEBUG"):
            raise
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if isinstance(e, KeyError):
            message = message.strip("'\"")
        print(f"error: {message}", file=sys.stderr)
        return 1
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
