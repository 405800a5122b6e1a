"""Per-system options: one typed dataclass per system, from `--option KEY=VALUE` or a suite's `options`.

Each system declares its dataclass, a CommonOptions, in its own file (its SystemSpec, megatrain.systems, which
parses them); a value of the wrong type is refused here with what the field takes. The record keeps the options
as given; systems read the parsed dataclass (CaseConfig.opts).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class CommonOptions:
    """Options every system has."""

    host_mem_gib: float | None = None  # the host's total for the pre-flight, on VMs whose MemTotal grows on use

    def __post_init__(self) -> None:
        check_field_types(self, "option")
        if self.host_mem_gib is not None and self.host_mem_gib <= 0:
            raise ValueError(f"option host_mem_gib must be > 0, got {self.host_mem_gib}")


def check_field_types(obj, label: str) -> None:
    """Each field of the dataclass obj against its annotation: ValueError '{label} NAME=VALUE: expected TYPE'."""
    check_values(type(obj), {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}, label)


def check_values(cls, values: dict, label: str) -> None:
    """Each value against the annotation of the field of its name in dataclass cls (other names are not checked), as
    check_field_types, before an instance is made of them."""
    hints = typing.get_type_hints(cls)
    for name, value in values.items():
        if name in hints and not _is_a(value, hints[name]):
            raise ValueError(f"{label} {name}={value!r}: expected {_describe(hints[name])}")


def _is_a(value, hint) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_is_a(value, h) for h in args)
    if origin is list:
        return isinstance(value, list) and all(_is_a(v, args[0]) for v in value)
    if origin is tuple and args[-1:] == (Ellipsis,):  # tuple[X, ...]: any length
        return isinstance(value, (list, tuple)) and all(_is_a(v, args[0]) for v in value)
    if origin is tuple:  # a TOML or JSON array stands for a tuple
        return isinstance(value, (list, tuple)) and len(value) == len(args) and all(map(_is_a, value, args))
    if origin is Literal:
        return value in typing.get_args(hint) and not isinstance(value, bool)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, hint)


def _describe(hint) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(h) for h in typing.get_args(hint))
    if origin is Literal:
        return " or ".join(repr(a) for a in typing.get_args(hint))
    if origin is list:
        return f"a list, each {_describe(typing.get_args(hint)[0])}"
    if origin is tuple:
        return f"a list of {len(typing.get_args(hint))}, each {_describe(typing.get_args(hint)[0])}"
    return {type(None): "null", bool: "true or false", int: "an integer", float: "a number", str: "a string",
            dict: "a table of KEY = VALUE"}.get(hint, str(hint))
