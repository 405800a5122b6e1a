"""A transformers causal LM with our model's interface, for the systems that own a module (native, FSDP2, DeepSpeed,
torchao): they train transformers' module itself, as its users do, and the engine streams the same modules.

GenericCausalLM holds the causal LM's own children, so its parameters keep transformers' names
('model.layers.0.self_attn.q_proj.weight', 'lm_head.weight'); its decoder layers are `layers` (each system's per-layer
sharding and compile); forward(tokens, labels, normalizer, segments, aux_weight) is megatrain.models.Transformer's:
the loss chunked over the head (megatrain.models.generic.head), every decoder layer checkpointed inside its forward
(transformers' own place for it: a sharding system's hooks stay outside the checkpoint).

It trains in train mode, as transformers' Trainer does: dropout and router jitter run as config.json sets them. A
model with such settings (megatrain.models.draws) reseeds the device's generator before its preamble and before each
decoder layer from `draws` (its training step and micro-batch, set by the system), so a checkpointed layer's recompute
draws what its forward drew (torch.utils.checkpoint restores the state the reseed left) and every system draws the
engine's masks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from megatrain.models.draws import Draws
from megatrain.models.generic.config import GenericConfig
from megatrain.models.generic.head import chunked_loss, cross_entropy_sum
from megatrain.models.generic.skeleton import Parts, build_causal_lm, head_logits
from megatrain.models.loss import valid_tokens
from megatrain.models.masks import document_positions


def position_ids(cfg: GenericConfig, rows: int, seq: int, segments_BS: torch.Tensor | None,
                 device: torch.device) -> torch.Tensor:
    """Position ids [rows, seq]: 0..seq-1, or for packed rows (segments_BS: each token's document) restarting at every
    document, from which transformers builds document masks (a position not following its predecessor starts one).
    Refused for a model whose non-attention layers (linear attention, state-space, convolution) would carry state
    across documents."""
    if segments_BS is None or bool((segments_BS == segments_BS[:, :1]).all()):
        return torch.arange(seq, device=device).expand(rows, -1)
    if why := cfg.packing_refusal():
        raise ValueError(why)
    return document_positions(segments_BS.to(device))


class GenericCausalLM(nn.Module):
    def __init__(self, cfg: GenericConfig, activation_checkpointing: bool = False, mlp_chunk_tokens: int = 0):
        super().__init__()
        if mlp_chunk_tokens:
            raise ValueError(f"option mlp_chunk_tokens chunks the hand-written SwiGLU; {cfg.family} runs through "
                             "transformers' own modules, whole: leave it 0")
        self.cfg = cfg
        causal_lm = build_causal_lm(cfg, torch.get_default_device())
        for name, child in causal_lm.named_children():
            self.add_module(name, child)
        object.__setattr__(self, "causal_lm", causal_lm)  # its forward runs the children registered above
        object.__setattr__(self, "parts", Parts(causal_lm))
        self.activation_checkpointing = activation_checkpointing
        if activation_checkpointing:
            for layer in self.layers:
                layer.forward = functools.partial(checkpointed, layer.forward)
        # what training draws, where config.json asks for dropout or jitter (None: nothing random, nothing reseeded)
        self.draws = Draws() if cfg.random_settings else None
        if self.draws is not None:
            reseed_units(self.parts, self.draws, lambda: self.training)
        self.train()

    def train(self, mode: bool = True) -> GenericCausalLM:
        super().train(mode)
        self.causal_lm.training = mode  # not a registered child (its children are): its own flag too
        return self

    @property
    def layers(self) -> nn.ModuleList:
        return self.parts.layers

    def head_weight(self) -> torch.Tensor:
        return self.causal_lm.get_output_embeddings().weight

    def forward(self, tokens_BS: torch.Tensor, labels_BS: torch.Tensor | None = None,
                normalizer: float | None = None, segments_BS: torch.Tensor | None = None,
                aux_weight: float = 1.0) -> torch.Tensor:
        """Logits [B, S, V] without labels, else the summed token cross-entropy over `normalizer` (default: these
        labels' valid tokens). Packed rows (segments_BS) pass per-document position ids."""
        positions = position_ids(self.cfg, *tokens_BS.shape, segments_BS, tokens_BS.device)
        h = self.parts.base(input_ids=tokens_BS, position_ids=positions).last_hidden_state
        if labels_BS is None:
            return head_logits(self.parts, {}, h, final_norm=False)
        normalizer = normalizer or valid_tokens(labels_BS)
        module = self.parts.head_weight_name.rsplit(".", 1)[0] + "."
        head = {n: p for n, p in self.named_parameters() if n.startswith(module)}
        head.setdefault(self.parts.head_weight_name, self.head_weight())  # tied: the embedding's

        def chunk_loss(params, h_1TH, labels_T):  # the live head: a sharding system's hooks gather its weights
            return cross_entropy_sum(head_logits(self.parts, {}, h_1TH, final_norm=False), labels_T, normalizer)

        return chunked_loss(chunk_loss, head, h, labels_BS, self.cfg.vocab_size, bound=False)


def reseed_units(parts: Parts, draws: Draws, training: Callable[[], bool]) -> None:
    """Forward pre-hooks on a causal LM's decoder (unit 0: its preamble) and each decoder layer i (unit i + 1) that
    seed the device's generator for the unit's draws of `draws`' step and micro-batch, while training() says the
    model trains (a held-out loss draws nothing): what the engine's program does before each unit, on transformers'
    own modules (every module-owning system, and the references of the tests and the walk).

    A compiled layer leaves its hook out of its graph (torch.compiler.disable): traced, each seed would be a constant
    to recompile for (every unit and micro-batch of every step), until the recompile limit sent the layer to eager.
    Disabled here, where a model draws, and not on Draws itself: the decorator imports torch's compiler (~1.3 s),
    which a process that neither draws nor compiles never needs."""
    def hook(unit: int):
        @torch.compiler.disable
        def reseed(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if training():
                draws.reseed(unit, next(t.device for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)))
        return reseed

    parts.base.register_forward_pre_hook(hook(0), with_kwargs=True)
    for i, layer in enumerate(parts.layers):
        layer.register_forward_pre_hook(hook(i + 1), with_kwargs=True)


def checkpointed(forward, *args, **kwargs):
    """A decoder layer's forward, recomputed in backward (when gradients are on)."""
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)


@torch.no_grad()
def reset_buffers(module: torch.nn.Module, device: torch.device) -> None:
    """A module's buffers as its constructor makes them, on `device` (after to_empty, which leaves them unset): a
    transformers model's rotary tables, embedding scale, router biases; our Transformer has none."""
    if not any(True for _ in module.buffers()):
        return
    built = dict(build_causal_lm(module.cfg, "meta").named_buffers())
    for name, buffer in list(module.named_buffers()):
        owner, _, leaf = name.rpartition(".")
        module.get_submodule(owner)._buffers[leaf] = built[name].to(device, buffer.dtype)
