"""Command-line flags declared on the config dataclass fields they set.

A field carries its flag in its metadata (``field(default=..., metadata=flag("help"))``);
a command adds the flags of the fields it takes (``add_flags``) and reads them back as
the dataclass's keyword arguments (``flag_values``). The flag's name, type, default,
choices and help are the field's, so a knob shared by `specmask orchestrator`, `up` and
`serve` is declared once and cannot mean one thing on one command and another elsewhere.

From the field's type:

* ``int``, ``float``, ``str``, and each of them ``| None``: one value of that type;
* an ``enum.Enum`` (``| None`` too): one of its values, as the choices;
* ``bool``: ``--name`` / ``--no-name``;
* ``tuple[str, ...]``: the flag repeated (``--x a --x b``), or one value that
  ``Flag.convert`` splits (a comma-separated list);
* ``tuple[X, ...]`` of any other ``X``: the flag repeated, each value read by ``Flag.each``
  (``--tokenizer DIR:VOCAB`` -> a TokenizerSource).

Any other type is a ``TypeError`` when the parser is built: a field never becomes a flag
that parses to something else than its type says.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import math
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# The metadata key a field's Flag is kept under.
FLAG_KEY = "specmask.flag"


class _Unset(enum.Enum):
    """Flag.cli_default when the command line shows the field's own default."""

    UNSET = enum.auto()


@dataclass(frozen=True)
class Flag:
    """How one config field is given on a command line."""

    help: str
    # The option, when it is not --<field name with dashes>: a shorter or older spelling users know.
    name: str | None = None
    aliases: tuple[str, ...] = ()  # more spellings of the same flag (vLLM's names)
    metavar: str | None = None
    choices: tuple[str, ...] | None = None  # the values a str field takes (enums bring their own)
    # What the command line value becomes (e.g. -1 -> None for a port that is off, "a,b" -> ("a", "b")).
    # It runs when the values are read back, so a ValueError from it is a bad configuration.
    convert: Callable[[Any], Any] | None = None
    # The value the command line shows for the field's default, when convert maps it back (a port's -1).
    cli_default: Any = _Unset.UNSET
    # A repeated flag of a ``tuple[X, ...]`` field (X not str): what one value becomes. Like
    # convert, it runs when the values are read back (a ValueError is a bad configuration).
    each: Callable[[str], Any] | None = None


def flag(help: str, **options: Any) -> dict[str, Flag]:
    """A field's metadata declaring its flag: ``field(default=..., metadata=flag("..."))``."""
    return {FLAG_KEY: Flag(help, **options)}


@dataclass(frozen=True)
class _FieldFlag:
    """One field's flag as a command adds it: the argparse call, and the way back to the field."""

    field: str
    option_strings: tuple[str, ...]
    kwargs: Mapping[str, Any]
    to_value: Callable[[Any], Any]

    @property
    def dest(self) -> str:
        return str(self.kwargs["dest"])


def _optional_inner(hint: Any) -> tuple[Any, bool]:
    """(X, True) for ``X | None``, else (hint, False)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(hint)) == 2:
            return args[0], True
    return hint, False


def _identity(value: Any) -> Any:
    return value


def _number(text: str) -> float:
    """A float flag's value; NaN is refused, as no bound or timeout compares true against it
    (``nan <= 0`` is False: a NaN would pass every check a config makes)."""
    value = float(text)
    if math.isnan(value):
        raise argparse.ArgumentTypeError(f"not a number: {text!r}")
    return value


def _field_flag(
    config_cls: type, f: dataclasses.Field[Any], hint: Any, *, name: str | None, default: Any, help: str | None
) -> _FieldFlag:
    spec: Flag = f.metadata[FLAG_KEY]
    primary = name or spec.name or "--" + f.name.replace("_", "-")
    options = (primary, *spec.aliases) if name is None else (primary,)
    kwargs: dict[str, Any] = {"dest": primary.lstrip("-").replace("-", "_"), "help": help or spec.help}
    if spec.metavar is not None:
        kwargs["metavar"] = spec.metavar
    if default is dataclasses.MISSING:
        if spec.cli_default is not _Unset.UNSET:
            default = spec.cli_default
        elif f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()  # type: ignore[operator]  # typeshed: a MISSING union
    inner, optional = _optional_inner(hint)
    convert: Callable[[Any], Any] = spec.convert or _identity
    if inner is bool and not optional:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif isinstance(inner, type) and issubclass(inner, enum.Enum):
        enum_cls = inner
        kwargs["choices"] = [m.value for m in enum_cls]

        def convert(value: Any) -> Any:
            return None if value is None else enum_cls(value)

        if isinstance(default, enum.Enum):
            default = default.value
    elif inner in (int, float, str):
        kwargs["type"] = _number if inner is float else inner
        if spec.choices is not None:
            kwargs["choices"] = list(spec.choices)
    elif typing.get_origin(inner) is tuple and typing.get_args(inner) == (str, ...):
        if spec.convert is None:
            kwargs["action"] = "append"
            if default is not dataclasses.MISSING and len(default):
                # argparse appends what is given to the default (--x b on a default of a: [a, b])
                raise TypeError(f"{config_cls.__name__}.{f.name}: a repeated flag's default must be empty")
            default = []

            def convert(value: Any) -> Any:
                return tuple(value)

        else:
            kwargs["type"] = str
    elif typing.get_origin(inner) is tuple and typing.get_args(inner)[1:] == (...,) and spec.each is not None:
        each = spec.each
        kwargs["action"] = "append"
        if default is not dataclasses.MISSING:
            if len(default):  # argparse appends what is given to the default: it must be empty
                raise TypeError(f"{config_cls.__name__}.{f.name}: a repeated flag's default must be empty")
            default = []

        def convert(value: Any) -> Any:
            return tuple(each(v) for v in value)

    else:
        raise TypeError(f"{config_cls.__name__}.{f.name}: no flag for a field of type {hint!r}")
    if default is dataclasses.MISSING:
        kwargs["required"] = True
    else:
        kwargs["default"] = default
    return _FieldFlag(f.name, options, kwargs, convert)


def _flags(
    config_cls: type,
    fields: Iterable[str] | None,
    *,
    names: Mapping[str, str],
    defaults: Mapping[str, Any],
    helps: Mapping[str, str],
) -> list[_FieldFlag]:
    hints = typing.get_type_hints(config_cls)
    declared = {f.name: f for f in dataclasses.fields(config_cls)}
    chosen = [n for n, f in declared.items() if FLAG_KEY in f.metadata] if fields is None else list(fields)
    out = []
    for field_name in chosen:
        f = declared.get(field_name)
        if f is None or FLAG_KEY not in f.metadata:
            raise TypeError(f"{config_cls.__name__}.{field_name} declares no flag")
        out.append(
            _field_flag(
                config_cls,
                f,
                hints[field_name],
                name=names.get(field_name),
                default=defaults.get(field_name, dataclasses.MISSING),
                help=helps.get(field_name),
            )
        )
    unknown = (set(names) | set(defaults) | set(helps)) - {f.field for f in out}
    if unknown:
        raise TypeError(f"overrides for fields not added: {sorted(unknown)}")
    return out


class ConfigFlags:
    """The flags of some of ``config_cls``'s fields, as one command spells them.

    ``fields``: which fields, in the order their flags are listed (None: every field that
    declares one, in declaration order). ``names``: a field's flag under another name on
    this command (`serve`'s ``--port`` is the HTTP port); such a flag drops its aliases.
    ``defaults``: a command line default other than the field's (as the command line
    writes it). ``helps``: help that says what the flag means on this command.
    """

    def __init__(
        self,
        config_cls: type,
        fields: Iterable[str] | None = None,
        *,
        names: Mapping[str, str] | None = None,
        defaults: Mapping[str, Any] | None = None,
        helps: Mapping[str, str] | None = None,
    ) -> None:
        self.config_cls = config_cls
        self._flags = _flags(config_cls, fields, names=names or {}, defaults=defaults or {}, helps=helps or {})

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(f.field for f in self._flags)

    def add_to(self, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        for f in self._flags:
            parser.add_argument(*f.option_strings, **f.kwargs)

    def values(self, args: argparse.Namespace) -> dict[str, Any]:
        """Field name -> value, from parsed ``args``; ValueError from a flag's convert."""
        return {f.field: f.to_value(getattr(args, f.dest)) for f in self._flags}
