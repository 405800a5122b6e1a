"""StreamingSystem: the MegaTrain engine as one trainer (the system protocol of megatrain.systems: step, system_config,
metrics, save_state, load_state, close); megatrain.systems.megatrain builds it for a case."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import statistics
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from megatrain.build_log import BUILD_LOG
from megatrain.compile_check import compile_check
from megatrain.engine.config import EngineConfig, refuse_delay_across_ranks
from megatrain.engine.distributed import Ranks
from megatrain.engine.host_optimizer import HostOptimizer
from megatrain.engine.plan import check_fits, host_bytes_per_param
from megatrain.engine.schedule import Schedule
from megatrain.engine.shared_store import ShardedHostOptimizer, SharedHostStore
from megatrain.engine.state import load_engine_state, save_engine_state, steps_from_json, steps_to_json
from megatrain.engine.store import HostStore
from megatrain.engine.streams import StreamSet
from megatrain.memory import GIB, peak_host_rss_gib
from megatrain.models.loss import valid_tokens
from megatrain.models.weights import copy_named_weights
from megatrain.optim.state_bytes import adamw_traffic_bytes_per_param


class StreamingSystem:
    def __init__(self, config: EngineConfig, ranks: Ranks | None = None):
        """config: this process's share of the work (with several ranks, Ranks.per_rank's); ranks: this process's
        place among them (default: started alone, the one rank)."""
        ranks = ranks or Ranks.alone(config.device)
        self.config, self.ranks = config, ranks
        self.device = ranks.device
        self.build_phases_s: dict[str, float] = {}
        with self._phase("plan"):
            self.plan = check_fits(config)
        if not self.plan.fits:
            raise ValueError(f"configuration does not fit: {self.plan.reason}; {self.plan.advice}")
        self.num_params = config.model.num_params()
        cuda = self.device.type == "cuda"
        # ranks of a launch share their node's one copy of the state, each updating its shard
        store = functools.partial(SharedHostStore, ranks=ranks) if ranks.launched else HostStore
        refuse_delay_across_ranks(config.options, ranks.launched)
        with self._phase("host_store"):  # allocated, and the streamed tiles pinned
            self.store = store(config.model, config.torch_dtype, config.precision, pin=cuda,
                               moments=config.optim.moments, update_delay=config.options.update_delay)
        with self._phase("init"):
            self.store.initialise(config.seed, self.device)
        resident = self.plan.resident_units
        with self._phase("optimizer"):  # the host AdamW kernel (built once per machine) and its threads
            self.optimizer = (ShardedHostOptimizer if ranks.launched else HostOptimizer)(
                self.store, config.optim, kernel=config.options.optimizer_kernel, skip=frozenset(resident))
        with self._phase("schedule"):  # streams, GPU buffers, resident units, the layer template
            self.streams = StreamSet(self.device, timeline=config.options.timeline,
                                     stress_seed=config.options.stream_stress)
            self.schedule = Schedule(config, self.store, self.optimizer, self.streams, self.device, resident,
                                     self.plan.offloaded_layers, self.plan.recomputed_inputs, ranks)
        self.draws = self.schedule.draws  # dropout's seeds: train sets their step (a resumed run draws the same)

    @contextlib.contextmanager
    def _phase(self, name: str):
        """Time one phase of the build into build_phases_s and say it as it ends (megatrain.build_log: stderr, or a
        caller's log), so a build cut short (a suite case's timeout keeps the stderr tail) shows how far it got and
        what each phase took."""
        t0 = time.perf_counter()
        yield
        if self.device.type == "cuda" and torch.cuda.is_initialized():
            torch.cuda.synchronize(self.device)
        self.build_phases_s[name] = round(time.perf_counter() - t0, 3)
        BUILD_LOG.info("megatrain build: %s %.1f s", name, self.build_phases_s[name])

    def step(self, inputs_BS: torch.Tensor, labels_BS: torch.Tensor, segments_BS: torch.Tensor | None = None) -> float:
        """One step over the global batch (with several ranks, each trains its rows of it)."""
        normalizer = valid_tokens(labels_BS)  # the global batch's, so N ranks' losses and gradients sum to one's
        inputs_BS, labels_BS, segments_BS = self.ranks.split_rows(inputs_BS, labels_BS, segments_BS)
        return self.schedule.step(inputs_BS, labels_BS, normalizer, segments_BS)

    @property
    def last_grad_norm(self) -> float:
        return self.schedule.history[-1]["grad_norm"] if self.schedule.history else float("nan")

    @property
    def skipped_steps(self) -> int:
        return self.schedule.skipped_steps

    def system_config(self) -> dict:
        return {
            "precision": self.config.precision,
            "compute_dtype": self.config.dtype,
            "weight_slots": len(self.schedule.weight_slots),
            "grad_slots": 2,
            "streams": ["h2d", "compute", "d2h"] if self.streams.cuda else ["host"],
            "optimizer": f"host AdamW ({self.optimizer.kernel} kernel) on flat tiles, " + self._update_timing(),
            "update_delay": self.config.options.update_delay,
            "update_delay_warmup": self.config.options.update_delay_warmup,
            "adamw_moments": self.config.optim.moments,
            "activation_checkpointing": self._checkpointing(),
            "offloaded_layers": self.schedule.acts.offloaded,
            "recomputed_inputs": self.schedule.acts.recomputed,
            "mlp_chunk_tokens": self.schedule.program.mlp_chunk_tokens,
            "compile": self.schedule.program.compiled,
            "compile_check": compile_check(fell_back=not self.schedule.program.compiled)
            if self.config.compile else None,
            "resident_units": sorted(self.schedule.resident),
            "plan": {k: v for k, v in dataclasses.asdict(self.plan).items() if k != "host_tiles_bytes_per_param"},
            "build_phases_s": self.build_phases_s,
            **({} if not self.ranks.launched else {
                "ranks": self.ranks.world, "host_state": "one copy in shared memory (/dev/shm), every rank maps it",
                "gradient_reduction": "fp32 on the device before the offload: reduce-scatter of whole shards in "
                                      "place (the remainder all-reduced); resident units all-reduced whole",
                "optimizer_sharding": "each rank updates its shard of every streamed unit; resident units "
                                      "replicated"}),
        }

    def _update_timing(self) -> str:
        options = self.config.options
        if not options.update_delay:
            return "overlapped with the next forward"
        warmup = f"after {options.update_delay_warmup} exact updates overlapped with the next forward, " \
            if options.update_delay_warmup else ""
        return f"{warmup}each update applying the previous step's gradient behind the whole next step " \
            "(update_delay=1: bounded staleness of one step)"

    def metrics(self, warmup_steps: int = 0) -> dict:
        timed = self.schedule.history[warmup_steps:] or self.schedule.history
        med = {k: statistics.median(h[k] for h in timed) for k in timed[0] if k not in ("grad_norm", "skipped")}
        step = med["step_s"]
        rss = peak_host_rss_gib() * GIB
        return {
            "h2d_bytes": med["h2d_bytes"],
            "d2h_bytes": med["d2h_bytes"],
            "h2d_gbps": med["h2d_bytes"] / step / 1e9,
            "d2h_gbps": med["d2h_bytes"] / step / 1e9,
            "compute_busy_s": med["compute_busy_s"],
            "gpu_idle_s": med["gpu_idle_s"],
            "gpu_idle_frac": med["gpu_idle_s"] / step,
            "compute_wait_s": med["compute_wait_h2d_s"],
            "compute_wait_frac": med["compute_wait_h2d_s"] / step,
            "exposed_optim_s": med["optim_wait_s"],
            "exposed_optim_frac": med["optim_wait_s"] / step,
            "grad_norms": [h["grad_norm"] for h in self.schedule.history],
            "pinned_host_bytes": self.store.pinned_bytes + self.schedule.acts.pinned_bytes,
            "host_store_bytes": self.store.host_bytes(),
            "host_store_bytes_per_param": self.store.host_bytes() / self.num_params,
            "host_bytes_per_param": rss / self.num_params,
            "timeline": self.schedule.timeline,
            **host_optimizer_rate(self.optimizer, host_bytes_per_param(self.config)),
            **(self._shared_memory_metrics() if self.ranks.launched else {}),
        }

    def _shared_memory_metrics(self) -> dict:
        """Ranks of a launch: each maps its node's one shared state, and its RSS counts every page of it that it
        touched; PSS splits a shared page between the ranks that map it, so summed over a node's ranks it counts each
        page once."""
        rss, pss = self.store.mapped_bytes()
        return {"ranks": self.ranks.world, "ranks_per_node": self.ranks.local_world, "host_state_rss_bytes": rss,
                "host_state_pss_bytes_node": sum(self.ranks.gather(pss, node=True))}

    def _checkpointing(self) -> str:
        acts, layers = self.schedule.acts, self.config.model.num_layers
        recomputed = f"layers 2-{acts.recomputed + 1}'s not kept but regenerated in backward by running layers " \
            f"1-{acts.recomputed} forward again, " if acts.recomputed else ""
        offloaded = f"layers {acts.host_indices.start + 1}-{acts.host_indices.stop}'s saved in pinned host memory, " \
            if acts.offloaded else ""
        return f"every layer of {layers}, from its saved input: {recomputed}{offloaded}the rest on the GPU; each " \
            "layer recomputed in backward"

    def evaluate(self, inputs_BS: torch.Tensor, labels_BS: torch.Tensor,
                 segments_BS: torch.Tensor | None = None) -> float:
        return self.schedule.evaluate(inputs_BS, labels_BS, valid_tokens(labels_BS), segments_BS)

    def set_lr(self, lr: float) -> None:
        self.schedule.lr = lr

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the weights (before training), one tensor at a time, by our parameter names (with several
        ranks, every rank calls it and each node's local rank 0 reads `named` into the node's copy)."""
        self.optimizer.flush()
        if self.ranks.node_first:  # one process a node fills its host copy: the weights, the program's buffers beside
            copy_named_weights({**self._weight_views(), **self.schedule.program.buffers()}, named)
            if self.store.master is not None:
                self.store.weights.copy_(self.store.master)
            elif self.store.ahead:  # update_delay: the new weights are the streamed ones too, nothing is pending
                self.store.weights.copy_(self.store.weights_next)
            self.store.ahead = False
        self.ranks.barrier()
        self.schedule.load_resident_from_host()

    def export_weights(self) -> dict[str, torch.Tensor]:
        """The current weights by our names, as views of the host tiles (fp32 master where there is one): no copy.
        With several ranks, rank 0's (its flush waits for every rank's updates); the others' is empty."""
        if not self.ranks.first:
            return {}
        self.optimizer.flush()
        self.schedule.sync_resident_to_host()
        return {**self._weight_views(), **{n: b.cpu() for n, b in self.schedule.program.buffers().items()}}

    def _weight_views(self) -> dict[str, torch.Tensor]:
        """Each parameter as a view of its host tile: the fp32 master where there is one, else the weights."""
        store = self.store
        src = store.master if store.master is not None else store.latest_weights
        return {slot.name: unit.view(store.tile(src, unit), slot) for unit in store.units for slot in unit.params}

    def save_state(self, out_dir: Path | None) -> None:
        """The full training state (weights, master, moments, step counts), streamed tile by tile. With several
        ranks every rank calls it (out_dir None but on rank 0), once every shard's update has landed rank 0 writes."""
        self.optimizer.flush()
        self.schedule.sync_resident_to_host()
        counters = {"step_count": self.optimizer.step_count, "skipped_steps": self.schedule.skipped_steps,
                    "adamw_steps": steps_to_json(self.optimizer.adamw.steps),
                    "resident_adamw_steps": steps_to_json(self.schedule.resident_adamw.steps),
                    "weights_ahead": self.store.ahead}
        if self.ranks.launched:  # the torch kernel counts steps per chunk of each rank's shards: all of them
            counters.update(shards=self.ranks.local_world, adamw_steps=[s for steps in self.ranks.gather(
                counters["adamw_steps"]) for s in steps])
        if self.ranks.first:
            save_engine_state(Path(out_dir), self.store, counters, self.schedule.program.buffers())

    def load_state(self, in_dir: Path | None) -> None:
        """Continue from a save_state directory (with several ranks, every rank calls it; each node's local rank 0
        reads in_dir into the node's copy)."""
        self.optimizer.flush()
        first = self.ranks.node_first  # one process a node fills its host copy
        meta = load_engine_state(Path(in_dir), self.store, self.schedule.program.buffers()) if first else None
        meta = self.ranks.from_first(meta)
        saved, shards = meta.get("shards", 1), self.ranks.local_world
        if saved != shards and self.optimizer.kernel == "torch":
            raise ValueError(f"{in_dir} was saved by {saved} rank(s) a node and the torch optimizer kernel counts "
                             "steps per chunk of each rank's shard: resume it on as many, or with "
                             "--option optimizer_kernel=fused")
        self.optimizer.step_count = meta["step_count"]
        self.store.ahead = meta.get("weights_ahead", False)
        self.schedule.skipped_steps = meta["skipped_steps"]
        self.optimizer.adamw.steps = steps_from_json(meta["adamw_steps"], torch.device("cpu"))
        self.schedule.resident_adamw.steps = steps_from_json(meta["resident_adamw_steps"], self.device)
        self.schedule.load_resident_from_host()

    def named_parameters_fp32(self) -> dict[str, torch.Tensor]:
        self.optimizer.flush()
        self.schedule.sync_resident_to_host()
        return self.store.named_parameters_fp32()

    def close(self) -> None:
        self.optimizer.close()
        self.store.close()
        self.schedule.acts.close()
        del self.schedule


def host_optimizer_rate(optimizer: HostOptimizer, per: dict[str, float]) -> dict:
    """The host optimizer's achieved rate over the run (its busy time): G params/s and the memory traffic that
    means in GB/s (megatrain.optim.state_bytes; megatrain.probe's host_mem_gbs is the machine's)."""
    if not optimizer.busy_s:  # every unit resident, or no step ran
        return {}
    gparams_s = optimizer.updated_params / optimizer.busy_s / 1e9
    traffic = adamw_traffic_bytes_per_param(per)
    return {"host_optim_gparams_s": gparams_s, "host_optim_bytes_per_param": traffic,
            "host_optim_gbs": gparams_s * traffic}
