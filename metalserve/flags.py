"""Command-line flags generated from config dataclass fields: one source for names, types, defaults, help.

How to add a `metalserve serve` flag: add one field to `EngineConfig` (metalserve/config.py) or
`ServerSettings` (metalserve/api/settings.py) whose default is `flag(...)`:

    max_num_seqs: int = flag(64, "most requests in one batch")

The flag is `--max-num-seqs` (the field name with dashes). From the field's type it gets
- `int`, `float`, `str` (or `X | None`): `type=X`;
- a `Literal[...]` or an `enum.StrEnum`: `choices` (its values; the config turns the text into the member);
- `bool`: `--name` sets True when the default is False; `--name/--no-name` when the default is True;
- anything else: give `parse=` (text -> value, run when the configs are built, so its ValueError reaches
  the user as `metalserve serve: error: ...`); without one, building the parser raises TypeError.
A field declared with `flag_group(Cls)` holds a config of its own whose flags join its owner's (in the
field's place, under the same names: ServerSettings' `images: ImageLimits = flag_group(ImageLimits)`).
The parser's default is the field's default (None for a `parse` or `when_absent` flag: absent, then the
field's default or `when_absent()`). A field with a plain default is not a flag. When both classes have
a field of one name (e.g. `tool_call_parser`), declare the flag on one of them: the value goes to both.
Cross-field rules belong in the class's `__post_init__`, which names the flags in its errors.
tests/test_flags.py parses every flag onto its field: give the new one a value there.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar

FLAG = "metalserve.flag"  # the key of a field's metadata that holds its Flag
GROUP = "metalserve.flag_group"  # the key of a field's metadata that marks a nested config of flags

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Flag:
    help: str
    choices: Sequence[Any] | Callable[[], Sequence[Any]] | None = None  # a callable: looked up when parsing
    parse: Callable[[Any], Any] | None = None  # text (a repeated flag: lists of words) -> value, when built
    when_absent: Callable[[], Any] | None = None  # the value when the flag is not given (else the default)
    aliases: tuple[str, ...] = ()  # more option strings, e.g. "-pp"
    positional: bool = False  # an optional positional argument (`metalserve serve MODEL`)
    repeated: bool = False  # each use takes one or more words; `parse` gets a list of lists, one per use


def flag(
    default: Any,
    help: str,
    *,
    choices: Sequence[Any] | Callable[[], Sequence[Any]] | None = None,
    parse: Callable[[Any], Any] | None = None,
    when_absent: Callable[[], Any] | None = None,
    aliases: tuple[str, ...] = (),
    positional: bool = False,
    repeated: bool = False,
) -> Any:
    """A dataclass field that is also a command-line flag (see the module docstring)."""
    spec = Flag(help, choices, parse, when_absent, aliases, positional, repeated)
    return dataclasses.field(default=default, metadata={FLAG: spec})


def flag_group(cls: type[T]) -> T:
    """A dataclass field holding a `cls` (default: `cls()`) whose flags are its owner's too."""
    return dataclasses.field(default_factory=cls, metadata={GROUP: cls})


def _leaf_flags(cls: type) -> list[tuple[type, dataclasses.Field[Any], Flag]]:
    """(declaring class, field, Flag) of every flag of `cls`, a flag group's in the group field's place."""
    leaves: list[tuple[type, dataclasses.Field[Any], Flag]] = []
    for f in dataclasses.fields(cls):
        if GROUP in f.metadata:
            leaves += _leaf_flags(f.metadata[GROUP])
        elif FLAG in f.metadata:
            leaves.append((cls, f, f.metadata[FLAG]))
    return leaves


def flag_fields(cls: type) -> list[tuple[dataclasses.Field[Any], Flag]]:
    """The fields of a config dataclass that are flags (a flag group's included), in declaration order."""
    return [(f, spec) for _, f, spec in _leaf_flags(cls)]


def option_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _without_none(hint: Any) -> Any:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return hint


def _help(f: dataclasses.Field[Any], spec: Flag) -> str:
    """The flag's help, with the field's default unless the help says it or the flag is a switch."""
    text = spec.help
    if f.default is not None and not isinstance(f.default, bool) and spec.when_absent is None:
        shown = json.dumps(list(f.default)) if isinstance(f.default, tuple) else f.default
        text += f" (default: {shown})"
    return text.replace("%", "%%")  # argparse formats help with %


def _argparse_kwargs(f: dataclasses.Field[Any], spec: Flag, hint: Any, owner: type) -> dict[str, Any]:
    """add_argument's keywords for one field: from its type, default and Flag."""
    kwargs: dict[str, Any] = {"help": _help(f, spec), "default": f.default}
    base = _without_none(hint)
    if spec.parse is not None or spec.when_absent is not None:
        kwargs["default"] = None  # absent: the field's default or when_absent(), applied by build()
    if spec.parse is not None:
        kwargs["metavar"] = f.name.upper()
        if spec.repeated:
            kwargs.update(nargs="+", action="append")
    elif base is bool:
        kwargs["action"] = argparse.BooleanOptionalAction if f.default in (True, None) else "store_true"
    elif typing.get_origin(base) is Literal:
        kwargs["choices"] = list(typing.get_args(base))
    elif isinstance(base, type) and issubclass(base, enum.StrEnum):
        kwargs["choices"] = [member.value for member in base]
    elif base in (int, float, str):
        kwargs["type"] = base
    else:
        raise TypeError(f"{owner.__name__}.{f.name}: a flag of type {hint} needs parse=")
    if spec.choices is not None:
        kwargs["choices"] = list(spec.choices() if callable(spec.choices) else spec.choices)
    return kwargs


def add_flags(parser: argparse.ArgumentParser, *classes: type) -> None:
    """One argument group per config class, one argument per flag field."""
    for cls in classes:
        group = parser.add_argument_group(cls.__name__, (cls.__doc__ or "").strip().splitlines()[0])
        for owner, f, spec in _leaf_flags(cls):
            kwargs = _argparse_kwargs(f, spec, typing.get_type_hints(owner)[f.name], owner)
            if spec.positional:  # a tuple field takes the rest of the positional arguments
                group.add_argument(f.name, nargs="*" if isinstance(f.default, tuple) else "?", **kwargs)
            else:
                group.add_argument(option_name(f.name), *spec.aliases, dest=f.name, **kwargs)


def flag_values(args: argparse.Namespace, *classes: type) -> dict[str, Any]:
    """The flags' values by field name, parsed; an absent flag is left out (or given its when_absent())."""
    values: dict[str, Any] = {}
    for cls in classes:
        for f, spec in flag_fields(cls):
            value = getattr(args, f.name)
            if value is not None and spec.parse is not None:
                value = spec.parse(value)
            elif value is None and spec.when_absent is not None:
                value = spec.when_absent()
            if value is not None:
                values[f.name] = value
    return values


def build(cls: type[T], values: Mapping[str, Any]) -> T:
    """`cls` from the flag values that name one of its fields (the rest keep their defaults); a flag
    group's field is built from the values in turn."""
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if GROUP in f.metadata:
            kwargs[f.name] = build(f.metadata[GROUP], values)
        elif f.name in values:
            kwargs[f.name] = values[f.name]
    return cls(**kwargs)
