"""StreamingSystem: the MegaTrain engine behind the common system protocol."""

from __future__ import annotations

import statistics

import torch

from megatrain.config import CaseConfig
from megatrain.engine.host_optimizer import HostOptimizer
from megatrain.engine.plan import check_fits
from megatrain.engine.schedule import Schedule
from megatrain.engine.store import HostStore
from megatrain.engine.streams import StreamSet
from megatrain.memory import GIB, peak_host_rss_gib
from megatrain.models.loss import valid_tokens


class StreamingSystem:
    def __init__(self, case: CaseConfig):
        self.case = case
        self.device = torch.device(case.device)
        self.plan = check_fits(case)
        if not self.plan["fits"]:
            raise ValueError(f"configuration does not fit: {self.plan['reason']}; {self.plan['advice']}")
        cfg = case.model_config()
        self.num_params = cfg.num_params()
        cuda = self.device.type == "cuda"
        self.store = HostStore(cfg, case.torch_dtype, case.precision, pin=cuda)
        self.store.initialise(case.seed, self.device)
        resident = self.plan["resident_units"]
        self.optimizer = HostOptimizer(self.store, case.optim, kernel=case.opts.optimizer_kernel,
                                       skip=frozenset(resident))
        self.streams = StreamSet(self.device, timeline=case.opts.timeline, stress_seed=case.opts.stream_stress)
        self.schedule = Schedule(case, self.store, self.optimizer, self.streams, self.device, resident)

    def step(self, inputs_BS: torch.Tensor, labels_BS: torch.Tensor) -> float:
        return self.schedule.step(inputs_BS, labels_BS, valid_tokens(labels_BS))

    @property
    def skipped_steps(self) -> int:
        return self.schedule.skipped_steps

    def system_config(self) -> dict:
        return {
            "precision": self.case.precision,
            "compute_dtype": self.case.dtype,
            "weight_slots": 2,
            "grad_slots": 2,
            "streams": ["h2d", "compute", "d2h"] if self.streams.cuda else ["host"],
            "optimizer": f"host AdamW ({self.optimizer.kernel} kernel) on flat tiles, overlapped with the next forward",
            "activation_checkpointing": "every layer, input saved " + (
                "in pinned host memory" if self.schedule.acts.offload else "on the GPU") + ", recomputed in backward",
            "mlp_chunk_tokens": self.schedule.layer_t.module.mlp.chunk_tokens,
            "compile": self.schedule.layer_t.compiled,
            "resident_units": sorted(self.schedule.resident),
            "plan": {k: v for k, v in self.plan.items() if k != "host_tiles_bytes_per_param"},
        }

    def metrics(self) -> dict:
        timed = self.schedule.history[self.case.warmup:] or self.schedule.history
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
        }

    def named_parameters_fp32(self) -> dict[str, torch.Tensor]:
        self.optimizer.flush()
        self.schedule.sync_resident_to_host()
        return self.store.named_parameters_fp32()

    def close(self) -> None:
        self.optimizer.close()
        self.store.close()
        self.schedule.acts.close()
        del self.schedule
