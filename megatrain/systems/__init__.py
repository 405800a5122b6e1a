"""The systems wing: MegaTrain's adapter (megatrain.py) and every peer it is compared with (native, DeepSpeed ZeRO-3
offload, FSDP2 offload, torchao, the paper's own code), each a file with its SPEC. The protocol they implement and the
one registry of them live in megatrain.systems_registry, below the case that asks it (megatrain.config); they are
handed on here, so `from megatrain.systems import SystemSpec` reads as it did."""

from megatrain.systems_registry import (
    SYSTEMS,
    Case,
    Registered,
    SystemSpec,
    TrainSystem,
    build_system,
    parse_options,
    system_spec,
)

__all__ = ["SYSTEMS", "Case", "Registered", "SystemSpec", "TrainSystem", "build_system", "parse_options",
           "system_spec"]
