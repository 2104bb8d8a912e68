"""The transmla command line. Commands live in one module each; this file wires them up.

Errors print as one line on stderr with exit code 1 (usage errors: 2; interrupted: 128 + signal);
set TRANSMLA_DEBUG=1 for the traceback.
"""

from __future__ import annotations

import os
import sys
import warnings

import typer

from ..messages import TransMLAWarning
from .bench import bench_app  # its kernels (triton) load inside the commands, so it imports without triton
from .convert import convert
from .evaluate import evaluate
from .export import export
from .finetune import finetune
from .generate import generate
from .inspect import inspect
from .options import flag_message, option_flags
from .signals import interrupt_on_signals
from .sweep import sweep

app = typer.Typer(
    name="transmla",
    help="Convert MHA/GQA Hugging Face checkpoints (Llama, Qwen2, Qwen3, Gemma 3, Mistral, Mixtral) into Multi-head Latent "
    "Attention, evaluate them (perplexity, KV-cache size, decode speed) and fine-tune them briefly.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.command()(convert)
app.command()(inspect)
app.command("eval")(evaluate)
app.command()(generate)
app.command()(export)
app.add_typer(bench_app, name="bench")
app.command("sweep")(sweep)
app.command("finetune")(finetune)


# Libraries whose warnings a CLI user cannot act on; silenced by module name. Our own warnings
# (transmla.messages.TransMLAWarning) are always shown, as one "warning:" line.
QUIET_MODULES = r"(torch|transformers|accelerate|huggingface_hub|tokenizers|safetensors|gguf|matplotlib|pydantic|numpy|gensim|smart_open)(\.|$)"


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    if issubclass(category, TransMLAWarning):
        print(f"warning: {message}", file=file or sys.stderr)
    else:
        _default_showwarning(message, category, filename, lineno, file, line)


_default_showwarning = warnings.showwarning


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for category in (UserWarning, FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=QUIET_MODULES)
    warnings.filterwarnings("always", category=TransMLAWarning)
    warnings.showwarning = _show_warning
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    message = text.splitlines()[0] if text else type(error).__name__
    return message.strip("'\"") if isinstance(error, KeyError) else message


def _run(argv: list[str] | None) -> int:
    """The app without typer's own exit handling: every outcome becomes an exit code and one line."""
    from typer._click import exceptions as cli_errors  # typer >= 0.29 ships its own click (pinned)

    try:
        code = app(args=argv, standalone_mode=False)  # a command's typer.Exit(n) comes back as n
    except cli_errors.NoArgsIsHelpError as e:  # bare `transmla` (or a bare group): the help
        text = e.format_message()
        if text.strip():  # typer's rich formatter has printed it already and returns ""
            print(text)
        return 0
    except cli_errors.UsageError as e:  # bad option value, missing argument, unknown command: exit 2
        hint = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
        print(f"error: {e.format_message()}{hint}", file=sys.stderr)
        return e.exit_code
    except cli_errors.ClickException as e:
        print(f"error: {e.format_message()}", file=sys.stderr)
        return e.exit_code
    except typer.Exit as e:
        return e.exit_code
    except typer.Abort:
        print("error: aborted", file=sys.stderr)
        return 1
    except Exception as e:  # one line for users; the traceback behind TRANSMLA_DEBUG
        if os.environ.get("TRANSMLA_DEBUG"):
            raise
        print(f"error: {flag_message(_first_line(e), option_flags())}", file=sys.stderr)  # the library names settings by field
        return 1
    return code if isinstance(code, int) else 0


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code (console scripts pass it to sys.exit).

    Ctrl-C, SIGTERM, SIGHUP and friends interrupt the command the same way (temporary output is
    removed on the way out) and end with one line and exit code 128 + the signal number.
    """
    _quiet_libraries()
    with interrupt_on_signals() as caught:
        try:
            code = _run(argv)
        except KeyboardInterrupt:  # raised outside the command (typer turns the command's into 130)
            code = 130
    if caught.signum is not None:
        print(f"error: interrupted ({caught.name})", file=sys.stderr)
        return 128 + caught.signum
    if code == 130:
        print("error: interrupted", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
