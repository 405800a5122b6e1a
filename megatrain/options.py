"""Per-system options: one typed dataclass per system, from `--option KEY=VALUE` or a suite's `options`.

A key the system does not have (a typo, or another system's option) and a value of the wrong type are
refused with a ValueError that lists the system's valid keys (the CLI's exit 2). The record keeps the
options as given; systems read the parsed dataclass (CaseConfig.opts).
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


@dataclass(frozen=True)
class MegaTrainOptions(CommonOptions):
    # saved layer inputs in pinned host memory (long contexts): all (true), none (false), the first K layers' (K), or
    # 'auto': as few as the GPU needs (the memory plan chooses)
    offload_activations: bool | int | Literal["auto"] = False
    # the saved inputs of layers 2..R+1 not kept at all: backward re-runs layers 1..R forward to regenerate them (their
    # weights cross PCIe a third time); 'auto': as few as let the host hold the offloaded rest (the memory plan chooses)
    recompute_inputs: int | Literal["auto"] = 0
    mlp_chunk_tokens: int = 0  # run the SwiGLU in chunks of this many tokens (0: whole micro-batch)
    optimizer_kernel: Literal["fused", "torch"] = "fused"  # host AdamW: one-pass kernel, or torch's fused AdamW
    resident_embedding: bool | Literal["auto"] = "auto"  # embedding state on the GPU ('auto': when it fits)
    resident_layers: int | Literal["auto"] = "auto"  # first K layers' state on the GPU ('auto': as many as fit)
    stream_stress: int | None = None  # debug: seed of random delays on every stream hand-off
    timeline: bool = True  # record the per-step stream timeline

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mlp_chunk_tokens < 0:
            raise ValueError(f"option mlp_chunk_tokens must be >= 0 (0: no chunking), got {self.mlp_chunk_tokens}")
        if type(self.offload_activations) is int and self.offload_activations < 0:
            raise ValueError(f"option offload_activations must be true, false, 'auto' or a layer count >= 0, got "
                             f"{self.offload_activations}")
        if self.recompute_inputs != "auto" and self.recompute_inputs < 0:
            raise ValueError(f"option recompute_inputs must be 'auto' or an integer >= 0, got {self.recompute_inputs}")
        if self.resident_layers != "auto" and self.resident_layers < 0:
            raise ValueError(f"option resident_layers must be 'auto' or an integer >= 0, got {self.resident_layers}")


@dataclass(frozen=True)
class NativeOptions(CommonOptions):
    activation_checkpointing: bool = True  # every layer checkpointed, as every system
    mlp_chunk_tokens: int = 0  # as megatrain's

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mlp_chunk_tokens < 0:
            raise ValueError(f"option mlp_chunk_tokens must be >= 0 (0: no chunking), got {self.mlp_chunk_tokens}")


@dataclass(frozen=True)
class DeepSpeedOptions(CommonOptions):
    optimizer: Literal["cpu_adam", "torch_adamw"] | None = None  # None: DeepSpeedCPUAdam on GPU, torch AdamW on CPU


@dataclass(frozen=True)
class FSDPOptions(CommonOptions):
    pass


OPTIONS: dict[str, type[CommonOptions]] = {
    "megatrain": MegaTrainOptions,
    "native": NativeOptions,
    "deepspeed": DeepSpeedOptions,
    "fsdp": FSDPOptions,
}


def parse_options(system: str, given: dict) -> CommonOptions:
    """The system's options from a {key: value} mapping (JSON/TOML values); ValueError names what to change."""
    cls = OPTIONS[system]
    valid = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in given if k not in valid]
    if unknown:
        owners = [s for s, c in OPTIONS.items() if unknown[0] in {f.name for f in dataclasses.fields(c)}]
        whose = f" (an option of {', '.join(owners)})" if owners else ""
        raise ValueError(f"{system} has no option {unknown[0]!r}{whose}; its options: {', '.join(valid)}")
    try:
        return cls(**given)
    except ValueError as exc:
        raise ValueError(f"{system}: {exc}") from None


def check_field_types(obj, label: str) -> None:
    """Each field of the dataclass obj against its annotation: ValueError '{label} NAME=VALUE: expected TYPE'."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if not _is_a(value, hints[f.name]):
            raise ValueError(f"{label} {f.name}={value!r}: expected {_describe(hints[f.name])}")


def _is_a(value, hint) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_is_a(value, h) for h in args)
    if origin is list:
        return isinstance(value, list) and all(_is_a(v, args[0]) for v in value)
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
