"""Rotary position embeddings and the context-extension scalings the released checkpoints use.

Each scaling changes only the inverse frequencies (and, for YaRN, multiplies cos and sin by an attention factor), so
one table of cos/sin per step serves every layer. The formulas are those of the papers as transformers implements
them (modeling_rope_utils): `linear` (position interpolation), `dynamic` (NTK-aware, base rescaled to the sequence
length), `llama3` (Llama 3.1's wavelength-banded interpolation) and `yarn` (NTK-by-parts with attention scaling).

`dynamic` is defined for training as transformers computes it for a batch of length S: the plain frequencies while
S <= max_position_embeddings, the base rescaled for S beyond (S is the step's padded sequence length).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE scaling of a checkpoint (rope_type other than 'default').

    Attributes:
        rope_type: 'linear', 'dynamic', 'llama3' or 'yarn'.
        factor: the context-extension factor (>= 1).
        original_max_positions: the pretraining context (llama3, yarn).
        low_freq_factor, high_freq_factor: llama3's wavelength band edges (as fractions of the original context).
        beta_fast, beta_slow: yarn's rotation counts bounding the interpolation ramp.
        attention_factor: yarn's cos/sin multiplier; None derives it from factor (and mscale, mscale_all_dim).
        mscale, mscale_all_dim: yarn's optional terms of the derived attention factor (DeepSeek's form).
        truncate: yarn rounds the ramp's bounds to whole dimensions (GPT-OSS sets false).
    """

    rope_type: str
    factor: float
    original_max_positions: int = 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES[1:]:
            raise ValueError(f"rope_type {self.rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
        if not self.factor >= 1:
            raise ValueError(f"RoPE scaling factor must be >= 1, got {self.factor}")
        if self.rope_type in ("llama3", "yarn") and self.original_max_positions < 1:
            raise ValueError(f"rope_type {self.rope_type!r} needs original_max_position_embeddings >= 1")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(f"llama3 RoPE needs high_freq_factor > low_freq_factor, got {self.high_freq_factor} "
                             f"and {self.low_freq_factor}")

    def to_dict(self) -> dict:
        return asdict(self)


def _plain_inv_freq(theta: float, head_dim: int, device) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float)
                            / head_dim))


def inv_freq_and_attention_factor(theta: float, head_dim: int, scaling: RopeScaling | None, max_positions: int,
                                  seq_len: int, device=None) -> tuple[torch.Tensor, float]:
    """The inverse frequencies [head_dim / 2] (fp32) and the factor cos and sin are multiplied by.

    Args:
        theta: the RoPE base.
        head_dim: the rotated width (every model here rotates the whole head).
        scaling: the checkpoint's scaling, None for plain RoPE.
        max_positions: the config's max_position_embeddings (dynamic's reference length).
        seq_len: the step's sequence length (only dynamic depends on it).
    """
    if scaling is None:
        return _plain_inv_freq(theta, head_dim, device), 1.0
    kind, factor = scaling.rope_type, scaling.factor
    if kind == "linear":
        return _plain_inv_freq(theta, head_dim, device) / factor, 1.0
    if kind == "dynamic":
        length = max(seq_len, max_positions)
        base = theta * ((factor * length / max_positions) - (factor - 1)) ** (head_dim / (head_dim - 2))
        return _plain_inv_freq(base, head_dim, device), 1.0
    if kind == "llama3":
        return _llama3(_plain_inv_freq(theta, head_dim, device), scaling), 1.0
    return _yarn(theta, head_dim, scaling, device)


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Wavelengths shorter than original/high_freq_factor kept, longer than original/low_freq_factor divided by the
    factor, the band between interpolated smoothly."""
    low_freq_wavelen = s.original_max_positions / s.low_freq_factor
    high_freq_wavelen = s.original_max_positions / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_positions / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(theta: float, head_dim: int, s: RopeScaling, device) -> tuple[torch.Tensor, float]:
    """Dimensions that rotate more than beta_fast times over the original context keep their frequency, those under
    beta_slow are interpolated by the factor, a linear ramp between; cos/sin scaled by the attention factor."""
    if s.attention_factor is not None:
        attention_factor = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attention_factor = _yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim)
    else:
        attention_factor = _yarn_mscale(s.factor)

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(s.original_max_positions / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # the ramp needs a width
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1).to(device)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).to(device=device, dtype=torch.float) / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def rotary_tables(cfg, seq_len: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [S, D] of model config `cfg` for positions 0..seq_len-1 (computed in fp32, cast to dtype)."""
    inv_freq, attention_factor = inv_freq_and_attention_factor(cfg.rope_theta, cfg.head_dim, cfg.rope_scaling,
                                                               cfg.max_seq_len, seq_len, device)
    freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * attention_factor).to(dtype), (emb.sin() * attention_factor).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x_BNSD: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor) -> torch.Tensor:
    return x_BNSD * cos_SD + _rotate_half(x_BNSD) * sin_SD
