"""The numbers we reproduce, copied here so that reports need nothing outside the repository.

Sources: MegaTrain (Yuan, Sun, Sun, Ye; arXiv:2604.05091), its tables as transcribed by secondary
write-ups (approximate), the public code's README (github.com/DLYuanGod/MegaTrain), and our own
measurements of that public code recorded in docs/DESIGN.md. TFLOPS are 6 x params x tokens / step
time, except the long-context figures: 6NT plus full-square attention, 12 x layers x hidden x seq x tokens
(megatrain.models.flops.paper_flops; the only convention that gives the 512k point's 407.4 TFLOPS from its 871 s
step). The paper's runs keep BF16 weights and gradients with FP32 Adam moments (our
`precision = "bf16"`), checkpoint every 4 layers, and use sequence length 1024 unless noted.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatrain.models.flops import model_flops, paper_flops
from megatrain.models.registry import MODELS, model_shape

PAPER = "paper (arXiv:2604.05091)"
README = "public code README"
DESIGN = "docs/DESIGN.md (public code, our run)"
SIX_NT = "6NT"
WITH_ATTENTION = "6NT + 12LHST"  # megatrain.models.flops.paper_flops


@dataclass(frozen=True)
class Claim:
    """One published number. tflops None means the system ran out of memory there."""

    what: str
    system: str  # megatrain | deepspeed | fsdp | native
    model: str  # our registry name for the paper's model
    seq: int
    tflops: float | None
    hardware: str
    source: str
    batch: int | None = None
    num_layers: int | None = None  # depth override of the registry shape
    flops: str = SIX_NT  # the FLOP count behind tflops
    step_time_s: float | None = None  # where the source states it


CLAIMS: list[Claim] = [
    Claim("GH200 7B", "megatrain", "qwen2.5-7b", 1024, 284, "GH200 96 GB", PAPER),
    Claim("GH200 14B", "megatrain", "qwen2.5-14b", 1024, 264, "GH200 96 GB", PAPER),
    Claim("GH200 32B", "megatrain", "qwen2.5-32b", 1024, 250, "GH200 96 GB", PAPER),
    Claim("GH200 14B ZeRO-3 offload (the 1.84x)", "deepspeed", "qwen2.5-14b", 1024, 143.6, "GH200 96 GB", PAPER),
    Claim("GH200 32B ZeRO-3 offload", "deepspeed", "qwen2.5-32b", 1024, None, "GH200 96 GB", PAPER),
    Claim("A100 PCIe 7B", "megatrain", "qwen2.5-7b", 1024, 128, "A100 PCIe 80 GB", PAPER),
    Claim("A100 PCIe 14B", "megatrain", "qwen2.5-14b", 1024, 122, "A100 PCIe 80 GB", PAPER),
    Claim("A100 PCIe 32B", "megatrain", "qwen2.5-32b", 1024, 114, "A100 PCIe 80 GB", PAPER),
    Claim("A100 PCIe 7B ZeRO-3", "deepspeed", "qwen2.5-7b", 1024, 36, "A100 PCIe 80 GB", PAPER),
    Claim("A100 PCIe 14B ZeRO-3", "deepspeed", "qwen2.5-14b", 1024, 10, "A100 PCIe 80 GB", PAPER),
    *[Claim(f"RTX 3090 {m}", "megatrain", f"qwen2.5-{m.lower()}", 1024, tflops, "RTX 3090", PAPER)
      for m, tflops in (("3B", 33.2), ("7B", 35.1), ("14B", 30.2))],
    Claim("RTX 3090 3B ZeRO-3", "deepspeed", "qwen2.5-3b", 1024, 23.9, "RTX 3090", PAPER),
    Claim("RTX 3090 14B ZeRO-3", "deepspeed", "qwen2.5-14b", 1024, None, "RTX 3090", PAPER),
    Claim("ablation 14B, full engine", "megatrain", "qwen2.5-14b", 1024, 266.3, "GH200 96 GB", PAPER, batch=96),
    *[Claim(f"depth scaling, {layers} layers", "megatrain", "qwen2.5-7b", 1024, tflops, "GH200 96 GB", PAPER,
            num_layers=layers) for layers, tflops in ((28, 284), (56, 264), (132, 247), (180, 227))],
    Claim("depth scaling, 84 layers (FSDP OOM from ~84)", "fsdp", "qwen2.5-7b", 1024, None, "GH200 96 GB", PAPER,
          num_layers=84),
    *[Claim(f"long context {seq // 1024}k", "megatrain", "qwen2.5-7b", seq, tflops, "GH200 96 GB", PAPER, batch=1,
            flops=WITH_ATTENTION, step_time_s=871.0 if seq == 524288 else None)
      for seq, tflops in ((1024, 284.7), (8192, 294.5), (32768, 316.7), (131072, 305.3), (262144, 401.2),
                          (524288, 407.4))],
    Claim("one H100, 7B", "megatrain", "qwen2.5-7b", 1024, 272, "H100", README),
    Claim("one H100, 32B (~327 GB host, ~40 GB GPU)", "megatrain", "qwen2.5-32b", 1024, 259, "H100", README, batch=96),
    Claim("public code, 7B", "megatrain", "qwen2.5-7b", 1024, 282, "H200, 256 GiB host", DESIGN, batch=128),
    Claim("whole model on GPU, HF kernels, 7B", "native", "qwen2.5-7b", 1024, 400, "H200, 256 GiB host", DESIGN,
          batch=16),
    Claim("public code, 3B", "megatrain", "qwen2.5-3b", 1024, 134, "H100", DESIGN, batch=32),
    Claim("public code, 3B", "megatrain", "qwen2.5-3b", 1024, 211, "H100", DESIGN, batch=128),
    Claim("whole model on GPU, HF kernels, 3B", "native", "qwen2.5-3b", 1024, 294, "H100", DESIGN),
]


# The paper's ablation of the same case ("ablation 14B, full engine": 14B, GH200, batch 96): its TFLOPS with one part
# of the engine turned off. Figures of MegaTrain without a part of it, so apart from CLAIMS, whose figures stand
# beside our full engine's
ABLATION_OF = "ablation 14B, full engine"
ABLATIONS = {"double buffering": 182.9, "gradient slab pool": 257.6}


def counterpart(claim: Claim) -> Claim | None:
    """The paper's MegaTrain figure a figure of another system stands against in its source (the same model, sequence,
    hardware and batch): the other half of a ratio the paper states, as 264 against DeepSpeed's 143.6 (its 1.84x)."""
    return next((c for c in CLAIMS if c.system == "megatrain" and c.source == claim.source and c is not claim and
                 (c.model, c.seq, c.hardware, c.batch) == (claim.model, claim.seq, claim.hardware, claim.batch)), None)


def mismatch(claim: Claim, model_name: str, num_layers: int, seq: int, batch: int) -> str | None:
    """Why a case of ours (registry model, depth, sequence, batch) is not the claim's case, or None when it is: a
    published figure stands beside ours only at the same model, depth, sequence and batch. A source that states no
    batch matches none."""
    depth = claim.num_layers or MODELS[claim.model].num_layers
    if (claim.model, depth) != (model_name, num_layers):
        return f"another model ({claim.model}, {depth} layers)"
    if claim.seq != seq:
        return f"another sequence length ({claim.seq})"
    if claim.batch is None:
        return "the source states no batch"
    if claim.batch != batch:
        return f"another batch ({claim.batch})"
    return None


def step_time_s(claim: Claim) -> float:
    """The claim's step time: as its source states it, or from its TFLOPS in its own FLOP count (needs its batch)."""
    if claim.step_time_s is not None:
        return claim.step_time_s
    cfg = model_shape(claim.model, claim.num_layers)
    flops = paper_flops(cfg, claim.batch, claim.seq) if claim.flops == WITH_ATTENTION else \
        model_flops(cfg.num_params(), claim.batch * claim.seq)
    return flops / (claim.tflops * 1e12)
