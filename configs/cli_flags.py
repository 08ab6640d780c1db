"""Command-line flags generated from pydantic config models (one source of truth for options).

``add_flags(parser, Model)`` adds ``--field-name`` for every field of ``Model`` (booleans get
``--flag/--no-flag``); ``collect(args, Model)`` returns only the values the user actually gave, so
config files and defaults underneath are not overridden by argparse defaults.
"""

from __future__ import annotations

import argparse
import types
import typing

from pydantic import BaseModel


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _scalar_type(annotation):
    """The argparse converter for a field annotation (``int | None`` -> int, Literal -> str)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _scalar_type(args[0])
    if origin is typing.Literal:
        return type(typing.get_args(annotation)[0])
    if origin in (tuple, list):
        return _scalar_type(typing.get_args(annotation)[0])
    return annotation if annotation in (int, float, str) else str


def default_text(value: object) -> str:
    """A field's default as help text shows it: unset (None), on/off (booleans), else its value."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value) if value != "" else "empty"


def section_of(model: type[BaseModel]) -> str:
    """The config section ``model`` fills (``engine``, ``scheduler``, ``server``, ``cluster``)."""
    from configs.schema import SECTIONS

    return next(name for name, m in SECTIONS.items() if m is model)


def add_flags(parser: argparse.ArgumentParser, model: type[BaseModel], skip: tuple[str, ...] = ()) -> None:
    section = section_of(model)
    group = parser.add_argument_group(f"{section} settings")
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        help_text = f"{field.description or ''} (default: {default_text(field.default)})"
        kwargs = {"dest": name, "default": argparse.SUPPRESS, "help": help_text}
        if field.annotation is bool:
            group.add_argument(_flag(name), action=argparse.BooleanOptionalAction, **kwargs)
            continue
        choices = None
        if typing.get_origin(field.annotation) is typing.Literal:
            choices = list(typing.get_args(field.annotation))
        origin = typing.get_origin(field.annotation)
        nargs = "*" if origin in (tuple, list) else None
        group.add_argument(_flag(name), type=_scalar_type(field.annotation), choices=choices, nargs=nargs, **kwargs)


def collect(args: argparse.Namespace, model: type[BaseModel]) -> dict:
    """Values given on the command line for ``model``'s fields (absent flags are left out)."""
    return {k: v for k, v in vars(args).items() if k in model.model_fields}
