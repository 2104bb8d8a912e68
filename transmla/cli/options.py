"""CLI flags derived from the option dataclasses, and library errors worded with flag names.

A command declares its own arguments as usual and takes `settings: dict`; `with_flags(fn, *flags)`
adds one Typer option per dataclass field (`kv_lora_rank` -> `--kv-lora-rank`, help from the
field's metadata) and hands the given values to `fn` in `settings`. The library words its errors
by field; `flag_message` turns field names into flag names (app.py applies it to every error).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Annotated, Any

import typer


@dataclass(frozen=True)
class Flag:
    name: str  # the dataclass field
    type: Any
    default: Any
    help: str
    decls: tuple[str, ...]


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def schema_flags(schema: type, *, exclude: Iterable[str] = (), unset_default: bool = False,
                 help_suffix: str = "") -> list[Flag]:
    """One Flag per field of `schema`. unset_default: every flag defaults to None ("not given":
    the schema's own default applies) and its help names that default."""
    hints = typing.get_type_hints(schema)
    flags = []
    for f in dataclasses.fields(schema):
        if f.name in exclude or "help" not in f.metadata:
            continue
        kind, default, help_text = hints[f.name], f.default, f.metadata["help"] + help_suffix
        if unset_default:
            if default is not None and kind is not bool and "default" not in help_text:
                help_text += f" (default: {default})"
            if default is not None:
                kind = kind | None
            default = None
        decls = (f.metadata.get("flag", flag_name(f.name)),) + ((f.metadata["short"],) if "short" in f.metadata else ())
        flags.append(Flag(f.name, kind, default, help_text, decls))
    return flags


def merge_flags(*groups: Iterable[Flag]) -> list[Flag]:
    """Flags of several schemas, each field once (the first schema naming it gives its help)."""
    seen: dict[str, Flag] = {}
    for group in groups:
        for flag in group:
            seen.setdefault(flag.name, flag)
    return list(seen.values())


def with_flags(fn: Callable, flags: list[Flag]) -> Callable:
    """`fn` with the flags added to its Typer signature; their values reach fn as `settings`."""
    sig = inspect.signature(fn, eval_str=True)
    own = [p for p in sig.parameters.values() if p.name != "settings"]
    extra = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                          annotation=Annotated[f.type, typer.Option(*f.decls, help=f.help)])
        for f in flags
    ]
    names = {f.name for f in flags}
    # Typer lists options in signature order: the command's own parameters, the derived flags,
    # then the command's keyword-only parameters (--json).
    first = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) if p.default is not inspect.Parameter.empty else p
             for p in own if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    last = [p for p in own if p.kind is inspect.Parameter.KEYWORD_ONLY]
    params = first + extra + last

    def command(*args, **kwargs):
        settings = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
        return fn(*args, settings=settings, **kwargs)

    command.__name__, command.__doc__, command.__module__ = fn.__name__, fn.__doc__, fn.__module__
    command.__signature__ = sig.replace(parameters=params)
    command.__annotations__ = {p.name: p.annotation for p in params}
    return command


def given(settings: dict[str, Any]) -> dict[str, Any]:
    """The flags the user set (None: not given)."""
    return {k: v for k, v in settings.items() if v is not None}


def flag_message(message: str, fields: dict[str, str]) -> str:
    """`message` with option field names written as flags (kv_lora_rank -> --kv-lora-rank): names
    with an underscore anywhere, one-word names (svd, seed, ...) only where they lead a rule
    ("svd must be ...", "freqfold does not apply to ..."), so prose keeps its words. A dotted name (mla.kv_lora_rank) is a config path and stays."""
    names = sorted(fields, key=len, reverse=True)
    joined = [n for n in names if "_" in n]
    words = [n for n in names if "_" not in n]
    if joined:
        pattern = re.compile(r"(?<![\w.-])(" + "|".join(map(re.escape, joined)) + r")(?![\w-])")
        message = pattern.sub(lambda m: fields[m.group(1)], message)
    if words:
        pattern = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, words)) + r")(?= must | does not apply)")
        message = pattern.sub(lambda m: fields[m.group(1)], message)
    return message


def option_flags() -> dict[str, str]:
    """Every field the CLI shows as a flag (conversion and evaluation settings) -> its flag."""
    from ..convert.options import COMMON_SCHEMAS
    from ..convert.registry import METHODS
    from ..eval.choice_tasks import ChoiceSettings
    from ..eval.code_task import CodeSettings
    from ..eval.passkey import PasskeySettings
    from ..eval.settings import EvalSettings

    schemas = (*COMMON_SCHEMAS, EvalSettings, PasskeySettings, ChoiceSettings, CodeSettings,
               *(m.Options for m in METHODS.values()))
    return {
        f.name: f.metadata.get("flag", flag_name(f.name))
        for s in schemas for f in dataclasses.fields(s) if "help" in f.metadata
    }
