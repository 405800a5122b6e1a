"""The random draws of training (dropout, a router's jitter noise: whatever a model does only in train mode), each made
from a seed of its own: one per (step, unit, micro-batch), where a unit is the preamble (0), a decoder layer (1..L)
or the head (L+1), as in megatrain.engine.layout.

Every system that trains a model with such settings reseeds the generator of the device before each unit's forward,
so a recomputed forward (the engine's backward, activation checkpointing) draws the masks its first forward drew, and
two systems that cut the same step into the same micro-batches draw the same masks: the streamed engine, plain
PyTorch and the sharded peers are compared with dropout on, as they are without. A model without such settings is
never reseeded (nothing to draw; a compiled layer keeps its graph whole).

A resumed run draws what the uninterrupted one drew: the step is the training step's index (train sets it before
each step), not a count of this process's steps.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

# config.json keys of a train-mode random op (dropout, DropPath, router or input jitter): attention_dropout,
# residual_dropout, hidden_dropout_prob, resid_pdrop, embd_pdrop, router_jitter_noise, input_jitter_noise, ...
_RANDOM_KEY = re.compile(r"(dropout|pdrop|drop_path|jitter)", re.IGNORECASE)
# keys the name matches that no causal LM's training reads: a classification head's dropout
_NOT_TRAINED = frozenset({"classifier_dropout", "summary_first_dropout"})
_MASK_64 = (1 << 64) - 1


def random_settings(hf: Mapping) -> dict[str, float]:
    """The config.json settings (at the top level, or in a nested text config) that make training draw random
    numbers: dropout and jitter probabilities above 0."""
    found = {}
    for key, value in hf.items():
        if isinstance(value, Mapping):
            found.update({f"{key}.{k}": v for k, v in random_settings(value).items()})
        elif (isinstance(key, str) and _RANDOM_KEY.search(key) and key not in _NOT_TRAINED
              and isinstance(value, int | float) and not isinstance(value, bool) and value > 0):
            found[key] = float(value)
    return found


def _mix(x: int) -> int:
    """splitmix64's finaliser: every input bit moves every output bit."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK_64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK_64
    return x ^ (x >> 31)


def draw_seed(seed: int, step: int, unit: int, micro_batch: int) -> int:
    """The seed of one unit's forward of one micro-batch of one step (63 bits: what manual_seed takes)."""
    x = seed & _MASK_64
    for value in (step, unit, micro_batch):
        x = _mix(x ^ (value & _MASK_64))
    return x >> 1


@dataclass
class Draws:
    """Where a system's training is: its step and micro-batch, which with a unit name the seed of a forward."""

    seed: int = 0
    step: int = 0
    micro_batch: int = 0  # this process's micro-batch of the step
    first_micro_batch: int = 0  # under torchrun, the step's micro-batches before this rank's: ranks draw as one would

    def reseed(self, unit: int, device: torch.device) -> None:
        """Seed `device`'s default generator for `unit`'s forward of the current micro-batch and step."""
        if device.type == "cuda":
            generator = torch.cuda.default_generators[device.index if device.index is not None
                                                      else torch.cuda.current_device()]
        else:
            generator = torch.default_generator
        generator.manual_seed(draw_seed(self.seed, self.step, unit, self.first_micro_batch + self.micro_batch))
