"""The paper's own code as a peer: the public MegaTrain (github.com/DLYuanGod/MegaTrain, Apache-2.0, package
`infinity`), run the way its single-GPU SFT entry point, examples/sft/train.py, runs it, with its own settings, on
our random-init model written as a Hugging Face checkpoint.

What runs is theirs. train.py loads the checkpoint with transformers (bf16, on the host, its attention
implementation), wraps it in their CPUMasterModel (bf16 weights on the host, each layer streamed to the GPU and run
forward three times per micro-batch: the forward, the recompute of its checkpoint block, the recompute inside its
backward) and steps it as `step` does, call for call: forward_and_backward, then, with the GPU idle,
torch.nn.utils.clip_grad_norm_ over the host gradients, the optimizer, _sync_params_to_gpu (every layer's pinned copy
refreshed) and the two zero_grads. The optimizer is their YAML's `deepspeed_adam`, DeepSpeedCPUAdam(adamw_mode=True)
over one group of every parameter, updating the bf16 weights in place: there is no fp32 master, so an update below
half a bf16 ulp of its weight is lost (`adamw`: their fallback, torch.optim.AdamW). Their YAML defaults for one GPU
(checkpoint_interval 4, num_grad_slabs 12, CPUMasterConfig's own defaults) hold unless an option says otherwise; our
AdamW hyperparameters and clipping norm (OptimConfig) replace their YAML's, as every system gets the same.

Where this differs from their script, and why:
- attention: flash-attn's, with their 2-D padding mask, where flash-attn is installed (their YAML's
  flash_attention_2); otherwise transformers' SDPA with no mask (its causal kernel). Their single-GPU path hands the
  2-D mask to the decoder layers, which only flash-attn accepts; our rows have no left padding, so causal attention is
  what that mask means (right padding masks only positions whose labels are ignored). Sliding-window layers would
  need a mask: refused under SDPA.
- labels: their loss scores position t against label t + 1 (transformers' convention, labels = inputs) over the first
  seq - 1 positions; ours name each position's next token already, so they move one place right (`shifted_labels`)
  and each position is scored against its own next token, a row's last position not at all.
- data and timing: the harness's rows and its CUDA-synchronised timer around `step` (megatrain.bench.case) replace
  their dataset and their timer; metrics add their own forward and backward times (CUDA events) and the optimizer
  phase after backward, timed on the host to a synchronize.

Where the code is found: $MEGATRAIN_PAPER_CODE, else .paper/ in the workspace (scripts/paper_code.sh makes it from a
checkout, with the commit in .paper/COMMIT; the GPU host gets it as a carried folder), else an importable `infinity`
package. Their package must not be pip-installed into this environment: its distribution is also named megatrain.
It runs on one CUDA GPU, eager, bf16, one micro-batch per step, dense models; anything else is refused with one line.
The `train` command refuses it (SystemSpec.trains): a benchmark peer has no evaluation, export or resume here.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from megatrain.config import CaseConfig
from megatrain.engine import distributed
from megatrain.memory import backward_work_bytes, layer_input_bytes
from megatrain.models.checkpoint import save_checkpoint
from megatrain.models.init import init_param
from megatrain.models.kinds import KINDS
from megatrain.models.loss import IGNORE_INDEX
from megatrain.models.masks import SLIDING
from megatrain.models.shape import ModelShape
from megatrain.optim.state_bytes import FP32_BYTES, checkpoint_bytes_per_param, state_bytes_per_param
from megatrain.options import CommonOptions
from megatrain.preflight import estimate_plan, pinned_bytes
from megatrain.systems import SystemSpec
from megatrain.systems.common import load_deepspeed_cpu_adam, max_norm
from megatrain.workspace import WORKSPACE

REPOSITORY = "github.com/DLYuanGod/MegaTrain"
CODE_ENV = "MEGATRAIN_PAPER_CODE"
CODE_DIR = ".paper"  # in the workspace: what scripts/paper_code.sh makes
COMMIT_FILE = "COMMIT"
INIT_DIR = Path("scratch") / "paper_init"  # in the workspace: the initial checkpoints, one per shape, seed and GPU
BF16_BYTES = 2
ENTRY = ("examples/sft/train.py's step: model.forward_and_backward, clip_grad_norm_(model.get_parameters()), "
         "optimizer.step, model._sync_params_to_gpu, model.zero_grad, optimizer.zero_grad")


@dataclass(frozen=True)
class PaperOptions(CommonOptions):
    attn_implementation: Literal["auto", "flash_attention_2", "sdpa"] = "auto"  # auto: flash-attn's where installed
    optimizer: Literal["deepspeed_adam", "adamw"] = "deepspeed_adam"  # their YAML's optimizer.type
    checkpoint_interval: int | None = None  # layers per saved block; None: theirs (4)
    num_grad_slabs: int | None = None  # pinned gradient buffers; None: theirs (12)

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("checkpoint_interval", "num_grad_slabs"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ValueError(f"option {key} must be >= 1 (or left out: the paper code's default), got "
                                 f"{getattr(self, key)}")


def code_dir() -> Path | None:
    """The directory the paper's code is imported from: $MEGATRAIN_PAPER_CODE, else .paper/ in the workspace where
    it exists; None: an installed `infinity` package, if any."""
    if os.environ.get(CODE_ENV):
        return Path(os.environ[CODE_ENV])
    default = WORKSPACE / CODE_DIR
    return default if default.is_dir() else None


def missing_code() -> str | None:
    """Why the paper's code cannot be imported here, or None."""
    where = code_dir()
    if where is not None:
        if not (where / "infinity" / "__init__.py").is_file():
            return f"{where} holds no infinity/ package: point {CODE_ENV} at a checkout of {REPOSITORY}, or make " \
                   ".paper/ with scripts/paper_code.sh"
        return None
    if importlib.util.find_spec("infinity") is None:
        return f"the paper's code is not here: make .paper/ from a checkout of {REPOSITORY} with " \
               f"`bash scripts/paper_code.sh CHECKOUT`, or set {CODE_ENV}=DIR"
    return None


def attention(opts: PaperOptions) -> str:
    """The attention implementation that runs: the option, `auto` being flash-attn's where it is installed."""
    if opts.attn_implementation != "auto":
        return opts.attn_implementation
    return "flash_attention_2" if importlib.util.find_spec("flash_attn") else "sdpa"


def missing_here(case: CaseConfig) -> str | None:
    """What this environment lacks to run `case` with the paper's code (the code, a package it or an option needs),
    or None: installed later, the case runs (a suite that resumes runs it again)."""
    if reason := missing_code():
        return reason
    for module, install in (("transformers", "pip install -e '.[chat]'"), ("yaml", "pip install pyyaml"),
                            ("accelerate", "pip install accelerate")):  # accelerate: train.py's device_map="cpu"
        if importlib.util.find_spec(module) is None:
            return f"the paper's code needs {module}, which is not installed ({install})"
    if case.opts.optimizer == "deepspeed_adam" and importlib.util.find_spec("deepspeed") is None:
        return "the paper's optimizer, DeepSpeedCPUAdam (its YAML's deepspeed_adam), needs DeepSpeed: pip install " \
               "-e '.[deepspeed]', or --option optimizer=adamw (its fallback, torch.optim.AdamW)"
    if case.opts.attn_implementation == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        return "attn_implementation=flash_attention_2 needs flash-attn, which is not installed: leave the option " \
               "out (auto: SDPA without a mask)"
    return None


def refusal(case: CaseConfig, world: int = 1) -> str | None:
    """Why the paper's code cannot run `case` on `world` ranks, whatever the memory, if it cannot."""
    if reason := missing_here(case):
        return reason
    if case.device != "cuda":
        return "the paper's code runs on a CUDA GPU only (its streams, events and pinned buffers): run it with " \
               "--device cuda"
    if world > 1:
        return f"the paper's code runs one process on one GPU here (its several GPUs are its own worker processes, " \
               f"not torchrun), and this launch has {world} ranks: run it without torchrun"
    if case.precision != "bf16" or case.dtype != "bfloat16":
        return "the paper's code keeps bf16 weights and no fp32 master: run it with --precision bf16 --dtype bfloat16"
    if case.compile:
        return "the paper's code runs eager (transformers' layers, called by its own loop): run it without --compile"
    if case.micro_batch != case.batch:
        return f"the paper's code runs a step's {case.batch} rows in one forward and backward (train.py's " \
               "gradient_accumulation_steps counts loop iterations, each its own mean): run it with --micro-batch 0"
    cfg = case.shape()
    written = [family for kind in KINDS for family in kind.families]  # the families our modules are written for
    if cfg.family not in written:
        return f"the paper's code is compared on the hand-written families here ({', '.join(written)}); " \
               f"{case.model} is a {cfg.family}"
    if settings := cfg.random_settings:
        return f"the paper's code is compared on the hand-written models here, which have no dropout; {case.model} " \
               f"sets {', '.join(settings)}"
    if cfg.is_moe:
        return f"the paper's code is compared on dense models here; {case.model} is a mixture of experts"
    if SLIDING in cfg.layer_types and attention(case.opts) == "sdpa":
        return f"{case.model} has sliding-window layers, and under SDPA the paper's code passes no mask (they would " \
               "attend to the whole prefix): install flash-attn, or use a model without sliding windows"
    return None


def state_bytes(case: CaseConfig) -> dict[str, float]:
    """Bytes per parameter of its host state: bf16 weights and gradients; DeepSpeedCPUAdam's moments in fp32, torch
    AdamW's in the parameter dtype (bf16)."""
    return state_bytes_per_param(BF16_BYTES, "bf16",
                                 moment_bytes=FP32_BYTES if case.opts.optimizer == "deepspeed_adam" else BF16_BYTES)


def memory_bytes(case: CaseConfig, world: int = 1) -> tuple[int, int]:
    """(host bytes beyond the process overhead, GPU bytes), deliberately simple.

    Host: the state (state_bytes) and the pinned buffers of CPUMasterModel, each a block of torch's pinned allocator
    (pinned_bytes: a power of two): every layer's flat bf16 copy, two staging layers, num_grad_slabs layer gradient
    slabs, the head's and the embedding's slab. GPU: two flat layer buffers and two layer templates, the embedding,
    final norm and head with their gradients, the hidden states it saves (every checkpoint_interval-th layer's input
    and one block's recomputed inputs), and the larger of the loss's log-softmax over every position (its chunks stay
    in the graph until one backward, before any layer's) and a layer's recompute + backward.
    """
    cfg = case.shape()
    interval = case.opts.checkpoint_interval or 4
    slabs = case.opts.num_grad_slabs or 12
    layer_bytes = cfg.layer_params() * BF16_BYTES
    head_bytes = cfg.head_params() * BF16_BYTES
    embed_bytes = cfg.embedding_params() * BF16_BYTES
    host = int(cfg.num_params() * sum(state_bytes(case).values()))
    host += (cfg.num_layers + 2 + slabs) * pinned_bytes(layer_bytes) + pinned_bytes(head_bytes) + \
        pinned_bytes(embed_bytes)
    tokens = case.batch * case.seq
    saved = (-(-cfg.num_layers // interval) + 1 + interval) * layer_input_bytes(cfg, tokens, BF16_BYTES)
    logits = case.batch * (case.seq - 1) * cfg.vocab_size * BF16_BYTES
    gpu = 4 * layer_bytes + 2 * (head_bytes + embed_bytes) + saved + \
        max(logits, backward_work_bytes(cfg, tokens, BF16_BYTES))
    return host, gpu


def checkpoint_bytes(case: CaseConfig) -> int:
    """Its weights and optimizer moments (what a checkpoint of its state would hold; `train` does not run it)."""
    return int(case.shape().num_params() * checkpoint_bytes_per_param(state_bytes(case)))


plan_memory = functools.partial(estimate_plan, memory_bytes, refusal=refusal)


def shifted_labels(labels_BS: torch.Tensor) -> torch.Tensor:
    """Our labels as the paper's loss reads them: it scores position t against label t + 1, so each of ours moves one
    place right; the first is never read, and our last (a row's last position) is dropped."""
    return torch.cat([torch.full_like(labels_BS[:, :1], IGNORE_INDEX), labels_BS[:, :-1]], dim=1)


class InitialWeights(Mapping):
    """Our initial weights (megatrain.models.init) by our parameter name, each drawn on `device` when read (native
    draws them on the GPU it trains on), so a checkpoint is written one shard at a time."""

    def __init__(self, cfg: ModelShape, seed: int, device: torch.device | str):
        self.shapes = {unit.prefix + name: shape for unit in cfg.unit_shapes() for name, shape in unit.shapes}
        self.seed, self.device = seed, torch.device(device)

    def __getitem__(self, name: str) -> torch.Tensor:
        out = torch.empty(self.shapes[name], dtype=torch.float32, device=self.device)
        init_param(name, out, self.seed)
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def initial_checkpoint(case: CaseConfig, root: Path, device: torch.device | str) -> Path:
    """The case's initial weights as a bf16 Hugging Face checkpoint under `root`, written once per model shape, seed
    and device (random draws differ between GPU models) and reused: written beside its place and renamed there."""
    cfg = case.shape()
    device = torch.device(device)
    drawn_on = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    key = json.dumps({"config": cfg.to_dict(), "seed": case.seed, "device": drawn_on},
                     sort_keys=True)
    out = root / f"{case.model}-{hashlib.sha1(key.encode()).hexdigest()[:12]}"
    if not out.is_dir():
        partial = out.with_name(f"{out.name}.{os.getpid()}.partial")
        save_checkpoint(InitialWeights(cfg, case.seed, device), cfg, partial, 5 * 2**30, dtype=torch.bfloat16)
        partial.rename(out)
    return out


def _import_code():
    """Their `infinity` package (the code directory first on sys.path) and its commit, where one is recorded."""
    where = code_dir()
    if where is not None and str(where.resolve()) not in sys.path:
        sys.path.insert(0, str(where.resolve()))
    import infinity

    root = Path(infinity.__file__).resolve().parents[1]
    commit_file = root / COMMIT_FILE
    if commit_file.is_file():
        return infinity, commit_file.read_text().strip()
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True)
    return infinity, git.stdout.strip() if git.returncode == 0 else None


def their_config(infinity, case: CaseConfig, checkpoint: Path):
    """Their CPUMasterConfig for the case: their defaults (the YAML's for one GPU) but for the case's shape, batch,
    attention, AdamW hyperparameters and clipping norm, and the options given."""
    optim = case.optim
    given = {k: v for k, v in (("checkpoint_interval", case.opts.checkpoint_interval),
                               ("num_grad_slabs", case.opts.num_grad_slabs)) if v is not None}
    return infinity.CPUMasterConfig(
        model_name=str(checkpoint), dataset_name="(the harness's rows)", max_seq_len=case.seq, batch_size=case.batch,
        num_steps=case.steps, learning_rate=optim.lr, weight_decay=optim.weight_decay, beta1=optim.beta1,
        beta2=optim.beta2, eps=optim.eps, max_grad_norm=optim.max_grad_norm, seed=case.seed, dtype=torch.bfloat16,
        attn_implementation=attention(case.opts), **given)


def _unmasked(model_class: type) -> type:
    """Their CPUMasterModel handing the decoder layers no mask: SDPA's causal kernel, for rows without padding."""

    class Unmasked(model_class):
        def _build_layer_kwargs(self, mask, cache_position, position_ids, position_embeddings):
            return super()._build_layer_kwargs(None, cache_position, position_ids, position_embeddings)

    return Unmasked


class PaperSystem:
    def __init__(self, case: CaseConfig):
        if reason := refusal(case, distributed.launch_size()[0]):
            raise ValueError(reason)
        infinity, self.commit = _import_code()
        import transformers

        self.case, self.attn = case, attention(case.opts)
        self.transformers_version = transformers.__version__
        checkpoint = initial_checkpoint(case, WORKSPACE / INIT_DIR, "cuda")
        # as train.py loads it
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            checkpoint, torch_dtype=torch.bfloat16, device_map="cpu", trust_remote_code=True,
            attn_implementation=self.attn)
        # our names are transformers' without the `model.` prefix (models.handwritten.hf); the tensors are their
        # host weights, which CPUMasterModel keeps and the optimizer updates
        self.params = {name.removeprefix("model."): p for name, p in hf_model.named_parameters()}
        self.config = their_config(infinity, case, checkpoint)
        model_class = infinity.CPUMasterModel if self.attn == "flash_attention_2" else \
            _unmasked(infinity.CPUMasterModel)
        self.model = model_class(hf_model, self.config)
        del hf_model
        optim = case.optim
        hyper = dict(lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps, weight_decay=optim.weight_decay)
        if case.opts.optimizer == "deepspeed_adam":
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            load_deepspeed_cpu_adam()
            self.optimizer = DeepSpeedCPUAdam(self.model.get_parameters(), adamw_mode=True, **hyper)
        else:
            self.optimizer = torch.optim.AdamW(self.model.get_parameters(), **hyper)
        self.phases: list[dict[str, float]] = []  # per step: their forward and backward, the optimizer after them
        self.skipped_steps = 0  # their loop steps whatever the norm
        self.grad_norms: list[float] = []  # per step: clip_grad_norm_'s total norm, before the update applies it

    @property
    def last_grad_norm(self) -> float:
        return self.grad_norms[-1] if self.grad_norms else float("nan")

    def step(self, inputs_BS: torch.Tensor, labels_BS: torch.Tensor, segments_BS: torch.Tensor | None = None) -> float:
        if segments_BS is not None:
            raise ValueError("the paper's code trains unpacked rows only (its mask is one padding mask per row)")
        start = time.perf_counter()  # the harness synchronizes before a step
        loss, _, timing = self.model.forward_and_backward(inputs_BS, torch.ones_like(inputs_BS),
                                                          shifted_labels(labels_BS))
        backward_done = time.perf_counter()  # synchronized, every gradient accumulated on the host
        norm = torch.nn.utils.clip_grad_norm_(self.model.get_parameters(), max_norm(self.case.optim))
        self.optimizer.step()
        self.model._sync_params_to_gpu()
        self.model.zero_grad()
        self.optimizer.zero_grad()
        torch.cuda.synchronize()  # the head's and embedding's copies to the GPU
        end = time.perf_counter()
        self.phases.append({"forward_s": timing["forward"], "backward_s": timing["backward"],
                            "exposed_optim_s": end - backward_done, "step_s": end - start})
        self.grad_norms.append(float(norm))
        return loss

    def system_config(self) -> dict:
        ce = self.model.gpu_contexts[0].ce_loss
        return {"code": REPOSITORY, "commit": self.commit, "entry": ENTRY, "transformers": self.transformers_version,
                "attn_implementation": self.attn,
                "attention_mask": "their 2-D padding mask" if self.attn == "flash_attention_2" else
                "none: SDPA's causal kernel (their 2-D mask is flash-attn's only)",
                "cross_entropy": "flash_attn CrossEntropyLoss" if ce is not None else "torch cross_entropy",
                "checkpoint_interval": self.config.checkpoint_interval, "num_grad_slabs": self.config.num_grad_slabs,
                "optimizer": "deepspeed.ops.adam.DeepSpeedCPUAdam(adamw_mode=True), fp32 moments"
                if self.case.opts.optimizer == "deepspeed_adam" else "torch.optim.AdamW, bf16 moments",
                "weight_decay_on": "every parameter (one group, as train.py)",
                "master_weights": "none: bf16 weights updated in place", "clip": "clip_grad_norm_ on the host",
                "scored_positions": f"{self.case.seq - 1} of {self.case.seq} per row (their shift: a row's last "
                                    "position is not scored)",
                "initial_weights": "megatrain.models.init drawn on the GPU, written as a bf16 Hugging Face checkpoint"}

    def metrics(self, warmup_steps: int = 0) -> dict:
        """Medians over the timed steps of their forward and backward (CUDA events), of the optimizer phase after them
        (host timer), during which the GPU idles: all of it exposed, and of the step on the same host timer; every
        step's gradient norm (before its update, which their loop applies whatever the norm: a run that diverges
        shows whether the gradient or the update went non-finite first)."""
        timed = self.phases[warmup_steps:] or self.phases
        median = {key: statistics.median(p[key] for p in timed) for key in timed[0]}
        return {**median, "exposed_optim_frac": median["exposed_optim_s"] / median["step_s"],
                "grad_norms": self.grad_norms}

    def named_parameters_fp32(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().float().clone() for n, p in self.params.items()}

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def close(self) -> None:
        self.model.cleanup()
        del self.model, self.optimizer, self.params


SPEC = SystemSpec(factory=PaperSystem, options=PaperOptions, plan_memory=plan_memory, missing=missing_here,
                  checkpoint_bytes=checkpoint_bytes, trains=False)
