"""One-process distributed setup shared by the offload baselines (no launcher, world size 1)."""

from __future__ import annotations

import os
import socket
import warnings

from megatrain.config import CaseConfig


def single_process_env() -> None:
    """Rendezvous variables of a one-process world started without a launcher, on a free local port."""
    if os.environ.get("WORLD_SIZE", "1") != "1":
        raise ValueError("the offload baselines run one process on one device; start them without torchrun or the "
                         "deepspeed launcher (WORLD_SIZE must be unset or 1)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")


def warn_if_bf16_precision(case: CaseConfig, system: str) -> None:
    if case.precision == "bf16":
        warnings.warn(f"{system} ignores precision='bf16': it keeps fp32 master weights and optimizer state and "
                      f"computes in {case.dtype} (the 'mixed' recipe)", stacklevel=3)
