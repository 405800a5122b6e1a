"""Flags and TOML keys from one declaration (the idea of torchtitan's job config; our own, on argparse).

A dataclass field declared with `flag(...)` is a setting: its annotation is the flag's type, its default the
setting's, `--name-with-dashes` its flag and `name_with_underscores` its TOML key. `add_flags` gives a parser one flag
per setting, `given` reads back the flags given, `file_values` a TOML file's, and `flag_argv` writes an instance back
as the flags that rebuild it. A subclass re-declares a field (`seq: int = 2048`) to change only its default: the help
stays the base's, and a `{default}` in it names the default of the class the parser is made of.

`CaseFlags` is the one declaration of the case settings that `bench`, `train` and the suite runner share, and
`CaseFlags.make_case` the one place a case is made of them (bench's, train's and the Engine's).

How a type is spelled: bool a switch (`--no-NAME` when the default is true); list a repeatable flag; tuple that many
values; dict a repeatable KEY=VALUE, each value JSON (a bare word stays a string); int, float, str (or None) one value.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tomllib
import types
import typing
from dataclasses import dataclass
from pathlib import Path

from megatrain.config import CaseConfig
from megatrain.optim.config import MOMENTS, OptimConfig
from megatrain.run_config import DEVICES, DTYPES, PRECISIONS, RunConfig
from megatrain.systems import SYSTEMS


@dataclass(frozen=True)
class Flag:
    """How a setting reads on the command line, beyond what its field says."""

    help: str | None = None  # a '{default}' in it is replaced by the setting's default
    metavar: str | tuple[str, ...] | None = None
    choices: tuple | None = None


def flag(default=dataclasses.MISSING, *, factory=dataclasses.MISSING, **spec) -> dataclasses.Field:
    """A dataclass field that is a setting: `default` (or `factory()` for a mutable one) and Flag(**spec)."""
    return dataclasses.field(default=default, default_factory=factory, metadata={"flag": Flag(**spec)})


@dataclass(frozen=True)
class _Setting:
    name: str
    default: object
    kind: type  # bool, list, tuple, dict or the one value's type
    item: type | None  # a list's or tuple's element type, one value's type
    count: int  # a tuple's length
    spec: Flag

    @property
    def flag(self) -> str:
        negated = self.kind is bool and self.default is True
        return "--" + ("no-" if negated else "") + self.name.replace("_", "-")


def _spec(cls, name: str) -> Flag | None:
    """The Flag of field `name`: its own, or where a subclass re-declared only the default, its base's."""
    for base in cls.__mro__:
        f = getattr(base, "__dataclass_fields__", {}).get(name)
        if f is not None and "flag" in f.metadata:
            return f.metadata["flag"]
    return None


def _settings(cls) -> list[_Setting]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        spec = _spec(cls, f.name)
        if spec is None:
            continue
        hint = hints[f.name]
        if typing.get_origin(hint) in (typing.Union, types.UnionType):  # X | None: an X
            hint = next(h for h in typing.get_args(hint) if h is not type(None))
        kind, args = typing.get_origin(hint) or hint, typing.get_args(hint)
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        item = args[0] if args and kind in (list, tuple) else (None if kind in (bool, dict, str) else kind)
        out.append(_Setting(f.name, default, kind, item, len(args), spec))
    return out


def add_flags(parser: argparse.ArgumentParser, cls) -> None:
    """One flag per setting of the dataclass cls, each None when not given (so that `given` tells which were)."""
    for s in _settings(cls):
        help_text = s.spec.help.format(default=s.default) if s.spec.help else None
        common = {"dest": s.name, "default": None, "help": help_text}
        if s.kind is bool:
            parser.add_argument(s.flag, action="store_false" if s.default is True else "store_true", **common)
            continue
        typed = {"metavar": s.spec.metavar, "choices": s.spec.choices, "type": s.item}
        if s.kind in (list, dict):
            parser.add_argument(s.flag, action="append", **typed, **common)
        else:
            parser.add_argument(s.flag, nargs=s.count if s.kind is tuple else None, **typed, **common)


def given(cls, args: argparse.Namespace) -> dict:
    """The settings of cls given as flags (args from a parser add_flags made), by field name."""
    values = {}
    for s in _settings(cls):
        value = getattr(args, s.name, None)
        if value is not None:
            values[s.name] = parse_option_flags(value, s.flag) if s.kind is dict else value
    return values


def parse(cls, argv: list[str]):
    """An instance of cls from its flags alone."""
    parser = argparse.ArgumentParser()
    add_flags(parser, cls)
    return cls(**given(cls, parser.parse_args(argv)))


def flag_argv(obj) -> list[str]:
    """The flags that rebuild the dataclass obj: every setting that is not None, an unset switch or empty."""
    argv = []
    for s in _settings(type(obj)):
        value = getattr(obj, s.name)
        if s.kind is bool:
            argv += [s.flag] if value != s.default else []
        elif s.kind is dict:
            argv += [a for key, v in value.items() for a in (s.flag, f"{key}={json.dumps(v)}")]
        elif s.kind is list:
            argv += [a for v in value for a in (s.flag, str(v))]
        elif value is not None:
            argv += [s.flag, *map(str, value if s.kind is tuple else [value])]
    return argv


def parse_option_flags(items: list[str], flag_name: str = "--option") -> dict:
    """KEY=VALUE strings into a dict, each value JSON where it parses and a string where it does not."""
    options = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"{flag_name} takes KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        try:
            options[key] = json.loads(value)
        except (json.JSONDecodeError, RecursionError):
            options[key] = value
    return options


def file_values(cls, path: str | None, flag_name: str = "--config") -> dict:
    """The settings of cls a TOML file gives (keys: the field names; a list's one value may stand alone)."""
    if path is None:
        return {}
    try:
        values = tomllib.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError) as exc:
        raise ValueError(f"{flag_name} {path}: {exc}") from None
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"{flag_name} {path}: unknown keys {unknown}; valid: {', '.join(sorted(names))}")
    for s in _settings(cls):
        if s.kind is list and isinstance(values.get(s.name), str):
            values[s.name] = [values[s.name]]
    return values


# the case settings whose flags are the settings themselves: the system and the shared ones (RunConfig's) but AdamW's,
# whose flags are its fields (CaseFlags.optim)
CASE_SETTINGS = ("system", *(f.name for f in dataclasses.fields(RunConfig) if f.name != "optim"))


@dataclass
class CaseFlags:
    """The case settings every command takes, declared once, with the defaults of the settings every system shares
    (megatrain.run_config.RunConfig); a command's class may re-declare one's default."""

    system: str = flag(CaseConfig.system, help=" | ".join(SYSTEMS) + " (default {default})")
    device: str = flag(RunConfig.device, choices=DEVICES)
    dtype: str = flag(RunConfig.dtype, choices=DTYPES)
    precision: str = flag(RunConfig.precision, choices=PRECISIONS)
    compile: bool = flag(RunConfig.compile, help="torch.compile each decoder layer (every system; eager without it)")
    option: dict = flag(factory=dict, metavar="KEY=VALUE", help="system-specific setting (JSON value), repeatable")
    seq: int = flag(RunConfig.seq, help="tokens per sequence (default {default})")
    batch: int = flag(RunConfig.batch, help="sequences per optimizer step (default {default})")
    micro_batch: int = flag(RunConfig.micro_batch, help="sequences per forward/backward (0 = batch, the default)")
    lr: float = flag(OptimConfig.lr, help="peak learning rate (default {default})")
    weight_decay: float = flag(OptimConfig.weight_decay, help="on tensors of 2+ dimensions")
    max_grad_norm: float = flag(OptimConfig.max_grad_norm, help="global-norm clipping, 0 disables")
    moments: str = flag(OptimConfig.moments, choices=MOMENTS, help="AdamW's moments: fp32 (exact), bf16 (stochastic "
                        "rounding) or int8 (blocks with an absmax); megatrain engine only (default {default})")
    seed: int = flag(RunConfig.seed)

    def optim(self, **settings) -> OptimConfig:
        """AdamW's settings of these flags (and `settings`: OptimConfig's others, betas and eps)."""
        return OptimConfig(lr=self.lr, weight_decay=self.weight_decay, max_grad_norm=self.max_grad_norm,
                           moments=self.moments, **settings)

    def make_case(self, model: str, optim: OptimConfig | None = None, **settings) -> CaseConfig:
        """The case these settings make: the one place bench, train and the Engine make a CaseConfig. `model` is its
        registry name or label; `settings` the CaseConfig fields only a command sets (model_shape, steps, warmup,
        data, ranks, ...); optim, AdamW's settings where the command has more than these flags (default
        self.optim())."""
        shared = {name: getattr(self, name) for name in CASE_SETTINGS}
        return CaseConfig(model=model, **shared, optim=optim or self.optim(), options=self.option, **settings)
