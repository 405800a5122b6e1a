"""The baselines' process groups: one process started without a launcher (a world of one), or one rank of a torchrun
launch, data parallel over the ranks as megatrain is (megatrain/engine/distributed.py: the same groups, the same
split of the global batch, rank 0 writing the files)."""

from __future__ import annotations

import os
import socket
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from megatrain.config import CaseConfig
from megatrain.engine import distributed
from megatrain.engine.distributed import Ranks
from megatrain.models.loss import valid_tokens
from megatrain.run_config import share


def single_process_env() -> None:
    """Rendezvous variables of a one-process world started without a launcher, on a free local port."""
    if os.environ.get("WORLD_SIZE", "1") != "1":
        raise ValueError("the baselines run one process, or one per rank under torchrun: start them with torchrun, "
                         "not another launcher (WORLD_SIZE set without torchrun)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    distributed.started_own_world()  # its process groups' threads can abort the interpreter's teardown


def ranks_of(case: CaseConfig) -> Ranks:
    """This process's Ranks (under torchrun its rank's, else the one rank of a process started alone), once the ranks
    are known to share case.batch in whole micro-batches."""
    ranks = distributed.current(case.device)
    share(case.batch, case.micro_batch, ranks.world)
    return ranks


def rows_of_rank(ranks: Ranks, inputs_BS: torch.Tensor, labels_BS: torch.Tensor,
                 segments_BS: torch.Tensor | None) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(the step's loss normaliser, this rank's rows of each batch): the normaliser counts the valid tokens of the
    whole global batch, which every rank holds, so the ranks' losses and gradients sum to one process's."""
    normalizer = valid_tokens(labels_BS)
    return (normalizer, *ranks.split_rows(inputs_BS, labels_BS, segments_BS))


def summed_loss(ranks: Ranks, loss: torch.Tensor) -> float:
    """The step's loss: this rank's micro-batches' summed over the ranks."""
    return float(ranks.summed(loss))


def save_on_every_rank(ranks: Ranks, out_dir: Path | None, save: Callable[[Path], None]) -> None:
    """save(out_dir) of a system whose state is sharded across the ranks: under torchrun every rank writes its
    shards into rank 0's out_dir (the others pass None), and all have written before rank 0 goes on to checksum
    the files and swap the checkpoint in."""
    save(Path(ranks.from_first(out_dir)))
    ranks.barrier()


def kept_on_first(ranks: Ranks, gathered: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """{name: tensor} of `gathered`, whose every item the ranks gather together, kept on rank 0 only (the one that
    writes the export); each other rank drops each one as it comes."""
    return {name: t for name, t in gathered if ranks.first}


def warn_if_bf16_precision(case: CaseConfig, system: str) -> None:
    if case.precision == "bf16":
        warnings.warn(f"{system} ignores precision='bf16': it keeps fp32 master weights and optimizer state and "
                      f"computes in {case.dtype} (the 'mixed' recipe)", stacklevel=3)
