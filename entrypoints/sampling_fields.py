"""The sampling fields of the OpenAI request models and the CLI's sampling flags, derived from
SamplingParams' declarations (core/sampling_params.py: each field's type, default, help and
bounds, and where the OpenAI models or the CLI take it otherwise). A field added there appears
in both, with its default and bounds; nothing here names a field."""

from __future__ import annotations

import argparse
import typing

import msgspec

from pagedllm.core.sampling_params import FieldDeclaration, SamplingParams, field_declarations


def openai_fields(params_cls=SamplingParams) -> list[FieldDeclaration]:
    """The fields an OpenAI request takes as SamplingParams declares them."""
    return [d for d in field_declarations(params_cls) if d.extra["openai"]]


def openai_sampling_struct(base: type, params_cls=SamplingParams) -> type:
    """`base` (a msgspec Struct with the request's own fields and methods) with a field for each
    of `openai_fields`: its type (or openai_type) and default; null is taken as the default, as
    vLLM's server takes it."""
    fields = []
    for d in openai_fields(params_cls):
        kind = d.extra["openai_type"] or d.type
        if type(None) not in typing.get_args(kind):
            kind = kind | None
        fields.append((d.name, kind, d.default))
    return msgspec.defstruct(base.__name__.lstrip("_"), fields, bases=(base,), kw_only=True, module=base.__module__)


def openai_values(request, params_cls=SamplingParams) -> dict:
    """The SamplingParams keywords a request gives: its derived fields that are not null."""
    values = {}
    for d in openai_fields(params_cls):
        value = getattr(request, d.name)
        if value is not None:
            values[d.name] = value
    return values


def _flag(d: FieldDeclaration) -> str:
    return d.extra["flag"] or "--" + d.name.replace("_", "-")


def _dest(d: FieldDeclaration) -> str:
    return _flag(d)[2:].replace("-", "_")


def cli_fields(params_cls=SamplingParams) -> list[FieldDeclaration]:
    return [d for d in field_declarations(params_cls) if d.extra["cli"] is not False]


def _bounds(d: FieldDeclaration) -> str:
    """The declared bounds as the help shows them (those of a machine integer left out)."""
    lo, hi = (None if b is None or abs(b) >= 2**31 - 1 else b for b in (d.extra["lo"], d.extra["hi"]))
    if lo is None and hi is None:
        return ""
    if hi is None:
        return f"; {'>' if d.extra['lo_open'] else '>='} {lo}"
    if lo is None:
        return f"; <= {hi}"
    return f"; {lo}..{hi}" + (f", not {lo}" if d.extra["lo_open"] else "")


def add_sampling_flags(parser: argparse.ArgumentParser, params_cls=SamplingParams) -> None:
    """A flag per SamplingParams field the CLI takes: its type, default (the CLI's where
    declared), help and bounds; a list field's flag repeats."""
    group = parser.add_argument_group("sampling")
    for d in cli_fields(params_cls):
        default = d.default if d.extra["cli"] is True else d.extra["cli"]
        kinds = [k for k in (typing.get_args(d.type) or (d.type,)) if k is not type(None)]
        listed = [k for k in kinds if typing.get_origin(k) is list]
        text = d.help + _bounds(d) + ("" if default is None or default is False else " (default: %(default)s)")
        if kinds == [bool]:
            group.add_argument(_flag(d), dest=_dest(d), action="store_true", help=text)
        elif listed:
            item = typing.get_args(listed[0])[0]
            group.add_argument(
                _flag(d), dest=_dest(d), type=item, action="append", default=None, help=text + " (repeatable)"
            )
        else:
            group.add_argument(_flag(d), dest=_dest(d), type=kinds[0], default=default, help=text)


def sampling_values(args: argparse.Namespace, params_cls=SamplingParams) -> dict:
    """The SamplingParams keywords the parsed flags give."""
    return {d.name: getattr(args, _dest(d)) for d in cli_fields(params_cls)}
