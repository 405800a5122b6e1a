"""MegaTrain's line in the registry: the streaming engine (megatrain.engine) built for a benchmark or training case,
its pre-flight plan and its checkpoint size. The engine itself knows no case and no registry."""

from __future__ import annotations

import dataclasses

from megatrain.config import CaseConfig
from megatrain.engine import distributed
from megatrain.engine.config import EngineConfig, MegaTrainOptions
from megatrain.engine.plan import check_fits, host_bytes_per_param
from megatrain.engine.state import STATE_FILE, TILES_FILE
from megatrain.engine.trainer import StreamingSystem
from megatrain.memory import Budget
from megatrain.optim.state_bytes import checkpoint_bytes_per_param
from megatrain.systems import SystemSpec


def engine_config(case: CaseConfig) -> EngineConfig:
    """The engine's part of a benchmark or training case (its steps, warm-up and data stay the caller's)."""
    return EngineConfig(model=case.shape(), **case.run_settings(), options=case.opts)


def build(case: CaseConfig) -> StreamingSystem:
    """The engine for a case (its SystemSpec factory); under torchrun, this rank's."""
    ranks = distributed.current(case.device)
    return StreamingSystem(ranks.per_rank(engine_config(case)), ranks)


def preflight_plan(case: CaseConfig, limits: Budget) -> dict:
    """The pre-flight plan: the engine's own (check_fits, its exact tiles and choices against `limits`), with
    host_bytes what it counts against the host (on CPU, everything) and gpu_bytes 0 on CPU. Under torchrun: one
    rank's, with the host state counted once and each rank's process beside it."""
    plan = dict(dataclasses.asdict(check_fits(distributed.planned(engine_config(case)), limits)),
                source="megatrain.engine.plan")
    host, gpu = plan["host_need_bytes"], plan["gpu_bytes"] if case.device == "cuda" else 0
    plan.update(host_bytes=int(host), gpu_bytes=int(gpu))
    return plan


def checkpoint_bytes(case: CaseConfig) -> int:
    """One save_state: every host tile but the gradients (megatrain.engine.state)."""
    config = engine_config(case)
    return int(config.model.num_params() * checkpoint_bytes_per_param(host_bytes_per_param(config)))


SPEC = SystemSpec(factory=build, options=MegaTrainOptions, plan_memory=preflight_plan,
                  checkpoint_bytes=checkpoint_bytes, state_files=(STATE_FILE, TILES_FILE))
