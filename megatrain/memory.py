"""Host and GPU memory: the one budget every pre-flight judges against, what this process has used, and the
activations of a forward/backward that every pre-flight counts alike.

The rule, used by the engine's own plan, by `bench`'s and the suite's pre-flight of every system, and by
the report's batch projections:
- host: HOST_USABLE of the memory available when asked (MemAvailable, or a declared total less what is in
  use on VMs whose MemTotal grows as memory is touched: option host_mem_gib or MEGATRAIN_HOST_MEM_GIB).
  Estimates are estimates, and a host OOM takes more than the case down.
- GPU: a case is refused above the device's whole memory (a CUDA OOM ends only its case, and a margin
  would refuse batches that fit, which a largest-batch ladder measures); what a plan chooses to fill by
  itself (resident units) and what a projection assumes stops at GPU_FILL of it, leaving the allocator's
  fragmentation room.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass

import psutil
import torch

from megatrain.models.loss import chunk_tokens_for
from megatrain.models.shape import ModelShape

GIB = 2**30


HOST_USABLE = 0.92
GPU_FILL = 0.92
# Fixed per-process costs beyond the training state, the same in the engine's plan and every system's pre-flight
PROCESS_OVERHEAD_BYTES = 3 * GIB  # python, torch, CUDA context and libraries in host RSS
GPU_RESERVE_BYTES = 2 * GIB  # CUDA context, cuBLAS workspaces, allocator fragmentation


def host_memory_gib(declared_gib: float | None = None) -> tuple[float, float, str]:
    """(total, available, source) host memory in GiB. A declared total (argument, else MEGATRAIN_HOST_MEM_GIB)
    replaces MemTotal, for VMs whose MemTotal grows as memory is touched (the lent multi-GPU hosts read ~31 GiB
    until they have been filled); available is then that total less what is in use now."""
    vm = psutil.virtual_memory()
    declared, source = declared_gib, "option host_mem_gib"
    if declared is None and os.environ.get("MEGATRAIN_HOST_MEM_GIB"):
        declared, source = float(os.environ["MEGATRAIN_HOST_MEM_GIB"]), "MEGATRAIN_HOST_MEM_GIB"
    if declared is not None:
        return float(declared), float(declared) - (vm.total - vm.available) / GIB, source
    return vm.total / GIB, vm.available / GIB, "MemTotal"


def peak_host_rss_gib() -> float:
    """This process's peak resident set so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


@dataclass(frozen=True)
class Budget:
    """Bytes a case may use: host_bytes (HOST_USABLE already applied) and gpu_bytes (the whole device; None
    without a GPU)."""

    host_bytes: int
    gpu_bytes: int | None
    host_source: str

    @property
    def gpu_fill_bytes(self) -> int | None:
        return None if self.gpu_bytes is None else int(GPU_FILL * self.gpu_bytes)

    @staticmethod
    def of(host_available_gib: float, gpu_gib: float | None, host_source: str = "MemAvailable") -> Budget:
        gpu = None if gpu_gib is None else int(gpu_gib * GIB)
        return Budget(int(HOST_USABLE * host_available_gib * GIB), gpu, host_source)


def budget(device: str, host_mem_gib: float | None = None) -> Budget:
    """This machine's budget now, for a case on `device` ('cpu' or 'cuda')."""
    _, available, source = host_memory_gib(host_mem_gib)
    gpu = None
    if device == "cuda" and torch.cuda.is_available():
        gpu = torch.cuda.get_device_properties(0).total_memory / GIB
    return Budget.of(available, gpu, source)


# ---- activations ------------------------------------------------------------------------------------------------
# Every system runs megatrain.models' decoder layer and chunked loss with every layer checkpointed, so one count
# serves the engine's plan and every baseline's pre-flight. `tokens`: one forward/backward's (a micro-batch);
# `dtype_bytes`: bytes per activation element (the compute dtype).


def layer_input_bytes(cfg: ModelShape, tokens: int, dtype_bytes: int) -> int:
    """One layer input [tokens, H]: what checkpointing saves of a layer until its backward, and the size of the
    gradient flowing back through it."""
    return tokens * cfg.hidden_size * dtype_bytes


def layer_work_bytes(cfg: ModelShape, tokens: int, dtype_bytes: int, mlp_chunk_tokens: int = 0) -> int:
    """One decoder layer's recompute + backward beyond its input and output gradient: the saved activations (~11H +
    q/k/v per token; the MLP's 4I for one chunk of tokens, mlp_chunk_tokens, 0 the whole; flash/SDPA keeps no S x S
    matrix) and the gradients alive beside them.

    Calibrated on two kinds of peak. Short context, MLP whole (results/smoke_gpu, H200, Qwen2.5-1.5B/3B at batch 128):
    peak minus saved inputs and buffers was 0.87-0.89x of the count with 7H, ~0.78x of this one. Long context, MLP
    chunked (results/long_context/layer_profile-qwen2.5-7b-s524288.json: one 7B layer at 512k, cuDNN flash
    attention): 47.6 GiB beside its input, output gradient and weights, ~45k elements per token against 32k counted
    with 7H, so the attention block's share was raised to 11H: 0.97x of this count."""
    mlp_tokens = min(tokens, mlp_chunk_tokens or tokens)
    attention = tokens * (11 * cfg.hidden_size + cfg.q_size + 2 * cfg.kv_size)
    if cfg.is_moe:
        # a mixture of experts (never chunked): each token's K copies gathered in expert order, their gate/up, its
        # activation and the weighted outputs (K(2H + 4I)), and the router's fp32 probabilities; counted like the
        # dense MLP's 4I, not yet calibrated on a measured MoE peak
        k, e = cfg.num_experts_per_tok, cfg.num_experts
        return int(dtype_bytes * (attention + tokens * k * (2 * cfg.hidden_size + 4 * cfg.moe_intermediate_size))
                   + tokens * e * 4 * 2)
    return int(dtype_bytes * (attention + mlp_tokens * 4 * cfg.intermediate_size))


def loss_work_bytes(cfg: ModelShape, tokens: int, dtype_bytes: int) -> int:
    """The chunked loss's forward + backward (megatrain.models.loss): fp32 logits of one chunk and their gradient,
    the head's fp32 weight gradient and its per-chunk product."""
    logits = min(chunk_tokens_for(cfg.vocab_size), tokens) * cfg.vocab_size * 4 * 2
    return logits + cfg.head_matmul_params() * (4 + dtype_bytes)


def backward_work_bytes(cfg: ModelShape, tokens: int, dtype_bytes: int, mlp_chunk_tokens: int = 0) -> int:
    """The working set of one forward/backward beyond the saved inputs and the input and output gradient of what is
    computing: a layer's recompute + backward or the loss's, whichever is larger (they never run at once)."""
    return max(layer_work_bytes(cfg, tokens, dtype_bytes, mlp_chunk_tokens), loss_work_bytes(cfg, tokens, dtype_bytes))
