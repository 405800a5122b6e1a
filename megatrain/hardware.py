"""Hardware facts, in one place; measuring a machine is megatrain.probe's.

- the kinds of machine a suite's cases expect (`PROFILES`): GPU model and memory, host memory. A case belongs to
  one profile; the suite runner runs the cases whose profile the probed machine matches;
- the published figures of machines (hardware_specs.toml beside this file, `specs()`), which the performance model
  projects onto;
- the lent machines by GPU kind (`LENT`): which measured ingredient files (results/ingredients/) and which published
  figures belong to each.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatrain.probe import Machine


@dataclass(frozen=True)
class HardwareProfile:
    """What a case expects of the machine.

    Attributes:
        name: profile name used in suite files.
        gpu: substring of the CUDA device name ('H100', 'H200'); None for CPU-only cases.
        gpu_mem_gib: nominal device memory; None when gpu is None.
        host_mem_gib: nominal host memory; None means any (the CPU smoke profile).
        description: the machine in words.
    """

    name: str
    gpu: str | None
    gpu_mem_gib: float | None
    host_mem_gib: float | None
    description: str

    def mismatch(self, machine: Machine) -> str | None:
        """Why `machine` (the probe's) is not this kind of machine, or None when it is.

        GPU memory must be within 10% of nominal, host memory within 15% (reported totals sit a
        little below nominal, and a host twice as large would change which cases fit).
        """
        if self.gpu is not None:
            if not machine.gpu_name:
                return f"{self.name} needs a {self.gpu} GPU; this machine has none"
            if self.gpu.lower() not in machine.gpu_name.lower():
                return f"{self.name} needs a {self.gpu} GPU; this machine has {machine.gpu_name}"
            if abs(machine.gpu_mem_gib - self.gpu_mem_gib) > 0.1 * self.gpu_mem_gib:
                return f"{self.name} needs ~{self.gpu_mem_gib:.0f} GiB of GPU memory; this GPU has " \
                       f"{machine.gpu_mem_gib:.0f}"
        host = self.host_mem_gib
        if host is not None and abs(machine.host_mem_gib - host) > 0.15 * host:
            return f"{self.name} needs ~{self.host_mem_gib:.0f} GiB of host memory; this machine has " \
                   f"{machine.host_mem_gib:.0f}"
        return None


PROFILES: dict[str, HardwareProfile] = {p.name: p for p in (
    HardwareProfile("cpu-ci", None, None, None, "any machine, CPU only (CI: 2 cores, ~7 GiB)"),
    HardwareProfile("h100-80g", "H100", 79.2, 128, "one H100 80 GB (PCIe 5), 128 GiB host"),
    HardwareProfile("h200-141g-128g", "H200", 139.8, 128, "one H200 141 GB, 128 GiB host"),
    HardwareProfile("h200-141g-256g", "H200", 139.8, 256, "one H200 141 GB of a 2-GPU host with 256 GiB"),
    HardwareProfile("h200-141g-512g", "H200", 139.8, 512, "one H200 141 GB of a 4-8 GPU host with 512-560 GiB"),
    HardwareProfile("h100-80g-256g", "H100", 79.2, 256, "one H100 80 GB of a 2-GPU host with 256 GiB"),
    HardwareProfile("h100-80g-512g", "H100", 79.2, 512, "one H100 80 GB of a 4-8 GPU host with 512-560 GiB"),
)}
UNPROFILED = HardwareProfile("unprofiled", None, None, None, "a machine no profile describes (see 'measured')")


def actual_profile(planned: str, machine: Machine) -> str:
    """The profile of the machine a case ran on: `planned` when the machine matches it, else the first profile that
    matches (a suite run with --any-hardware), else 'unprofiled'. Records and reports name this one."""
    if get_profile(planned).mismatch(machine) is None:
        return planned
    return next((p.name for p in PROFILES.values() if p.gpu is not None and p.mismatch(machine) is None),
                "cpu-ci" if not machine.gpu_name else "unprofiled")


def get_profile(name: str) -> HardwareProfile:
    """The profile of that name; a ValueError that lists the valid names for an unknown one."""
    if name == UNPROFILED.name:
        return UNPROFILED
    if name not in PROFILES:
        raise ValueError(f"unknown hardware profile {name!r}; choose one of: {', '.join(PROFILES)}")
    return PROFILES[name]


def same_machine(a: Machine, b: Machine) -> bool:
    """Whether two probes describe the same kind of machine (a resumed run may continue)."""
    keys = ("gpu_name", "gpu_count", "cpu", "cpu_cores")
    return all(getattr(a, k) == getattr(b, k) for k in keys) and abs(a.host_mem_gib - b.host_mem_gib) <= \
        0.05 * max(a.host_mem_gib, b.host_mem_gib)


@dataclass(frozen=True)
class LentMachine:
    """A machine we were lent, as the performance model knows it.

    Attributes:
        ingredients: its measured ingredient files in results/ingredients/: the shapes and host rates, then any GPU
            rates measured in a later lease.
        spec: its published figures, a table name of hardware_specs.toml.
        owed: ingredient files of rates a model learned after the machine's last lease, loaded once measured (a
            prediction that needs such a rate names it until then).
    """

    ingredients: tuple[str, ...]
    spec: str
    owed: tuple[str, ...] = ()


# by GPU kind, a substring of the CUDA device name
LENT: dict[str, LentMachine] = {
    "H200": LentMachine(("h200-141g-128g.json", "h200-141g-128g-rates.json", "h200-141g-128g-moe.json"),
                         "h200-sxm-lent", owed=("h200-141g-128g-writeback.json",)),
    "H100": LentMachine(("h100-80g.json",), "h100-sxm-lent"),
}
SPECS = Path(__file__).with_name("hardware_specs.toml")


def specs() -> dict:
    """Published figures of machines, by table name (hardware_specs.toml)."""
    return tomllib.loads(SPECS.read_text())["profiles"]


def gpu_kind(name: str | None) -> str | None:
    """The lent machines' GPU kind that a CUDA device name names, or None."""
    return next((k for k in LENT if name and k in name), None)
