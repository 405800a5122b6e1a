"""The engine's program for a generic model: transformers' own modules as stateless templates.

Templates: one meta-device decoder layer of the model per distinct structure (megatrain.models.generic.skeleton: a
hybrid model has several, linear- and full-attention, dense and mixture-of-experts), each call binding the streamed
views of a layer through torch.func.functional_call; no per-layer module exists on the GPU. A layer's buffers (a
router's score correction) stay on the GPU beside it, the decoder's (rotary frequencies) beside the preamble.

Context: once per micro-batch the model's own forward runs with its layers replaced by recorders (Skeleton.capture),
which yields the first layer's input and the keyword arguments its layer loop passes each layer (position
embeddings, the mask of its attention type, position ids); forward, recompute and backward replay them. The
embedding unit's backward runs that preamble again with gradients (its embedding made sparse: the rows of the step's
tokens, not a [V, H] matrix, come back). The head is the model's own norm, LM head and logit transform, chunked
(megatrain.models.generic.head).

The templates train in train mode (dropout and router jitter as config.json sets them, each unit's forward of a
micro-batch drawing from its own seed: megatrain.models.draws), the held-out loss runs in eval mode.

Packed rows pass per-document position ids, from which transformers builds document masks (models.generic.module.
position_ids; a model with layers other than attention is refused packed rows).
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.func import functional_call

from megatrain.engine.layout import Unit
from megatrain.engine.templates import CompiledCall, add_rows
from megatrain.models.draws import Draws
from megatrain.models.generic.config import GenericConfig
from megatrain.models.generic.head import chunked_loss, cross_entropy_sum
from megatrain.models.generic.module import position_ids
from megatrain.models.generic.skeleton import PER_LAYER_ATTRIBUTES, Skeleton, head_logits
from megatrain.models.weights import persistent_buffers


@dataclass
class Context:
    """What one micro-batch's layers need besides their input: its position ids, and once the embedding has run,
    the keyword arguments the model's layer loop passes each layer."""

    position_ids: torch.Tensor  # [B, S]
    index: int = 0  # the micro-batch's, in this process's step (its draws' seeds: megatrain.models.draws)
    layer_kwargs: list[dict] = field(default_factory=list)


class ModuleTemplate(CompiledCall):
    """A transformers decoder layer (its meta-device module) called with bound weights and the layer's keyword
    arguments; its output's hidden states (a layer returning a tuple: the first)."""

    def __init__(self, module: nn.Module, compile_layer: bool):
        self.module = module
        self.indexed = [m for m in module.modules() if any(hasattr(m, a) for a in PER_LAYER_ATTRIBUTES)]
        # a code object of its own: Dynamo caches graphs per code object, so each template's (forward, recompute and
        # backward, per mask kind) count against its own recompile limit, not one that every template shares
        own = ModuleTemplate._layer.__code__.replace(co_name=f"_layer_{id(self):x}")
        super().__init__(types.MethodType(types.FunctionType(own, ModuleTemplate._layer.__globals__), self),
                         compile_layer)

    def _layer(self, params: dict, x_BSH: torch.Tensor, kwargs: dict) -> torch.Tensor:
        out = functional_call(self.module, params, (x_BSH,), kwargs)
        return out[0] if isinstance(out, tuple) else out

    def run(self, index: int, params: dict, x_BSH: torch.Tensor, kwargs: dict) -> torch.Tensor:
        for m in self.indexed:  # the layer's own index, where transformers keeps one
            for attribute in PER_LAYER_ATTRIBUTES:
                if hasattr(m, attribute):
                    setattr(m, attribute, index)
        return self(params, x_BSH, kwargs)


def _sanitized() -> bool:
    """Whether PyTorch's CUDA stream sanitizer is on (TORCH_CUDA_SANITIZER=1 enables it as torch is imported)."""
    sanitizer = sys.modules.get("torch.cuda._sanitizer")
    return bool(sanitizer is not None and sanitizer.cuda_sanitizer.enabled)


class GenericProgram:
    """transformers' own modules as the schedule runs them (megatrain.engine.templates.HandWrittenProgram says
    what a program is)."""

    def __init__(self, config, device: torch.device):
        cfg: GenericConfig = config.model
        if config.options.mlp_chunk_tokens:
            raise ValueError(f"option mlp_chunk_tokens chunks the hand-written SwiGLU; {cfg.family} runs through "
                             "transformers' own modules, whole: leave it 0")
        self.cfg, self.device, self.micro_batch, self.seq = cfg, device, config.micro_batch, config.seq
        self.skeleton = skeleton = Skeleton(cfg)  # this program's own: its modules are the templates
        embedding = skeleton.model.get_input_embeddings()
        if isinstance(embedding, nn.Embedding):
            # the embedding's gradient: the step's rows, not a [V, H] matrix; dense under PyTorch's CUDA stream
            # sanitizer, which reads every CUDA tensor's data pointer and a sparse one has none (its rows are then
            # added by the same add_ as a dense gradient's)
            embedding.sparse = not _sanitized()
        self.head_weight_name, self.embed_weight_name = skeleton.head_weight_name, skeleton.embedding_name
        self.base_buffers = skeleton.base_buffers(device)
        # the same under the causal LM's names, for the head (a final norm's buffers; the rest is not read there)
        self.head_buffers = {skeleton.base_prefix + n: b for n, b in self.base_buffers.items()}
        self.layer_buffers = [skeleton.layer_buffers(i, device) for i in range(cfg.num_layers)]
        self._persistent = list(persistent_buffers(skeleton.model))
        first = {}
        for i, s in enumerate(skeleton.structure):
            first.setdefault(s, i)
        self.templates = {s: ModuleTemplate(skeleton.layers[i], config.compile) for s, i in first.items()}
        # what training draws, where config.json asks for dropout or jitter: one seed per unit's forward of a
        # micro-batch of a step, so recompute replays its forward's masks (None: nothing random, nothing reseeded)
        self.draws = Draws(config.seed) if cfg.random_settings else None

    @property
    def compiled(self) -> bool:
        return all(t.compiled for t in self.templates.values())

    mlp_chunk_tokens = 0

    def contexts(self, segments_BS: torch.Tensor | None, micro_batches: int) -> list[Context]:
        """Each micro-batch's position ids (megatrain.models.generic.module.position_ids)."""
        positions = position_ids(self.cfg, micro_batches * self.micro_batch, self.seq, segments_BS, self.device)
        return [Context(positions[i:i + self.micro_batch], i // self.micro_batch)
                for i in range(0, positions.shape[0], self.micro_batch)]

    def train(self, mode: bool) -> None:
        """Train mode (dropout and jitter as config.json sets them) or eval mode (a held-out loss) for every
        template and the preamble."""
        self.skeleton.model.train(mode)

    def _reseed(self, unit: int, context: Context) -> None:
        """Before unit `unit`'s forward (first, recomputed or in backward) of a micro-batch: its draws' seed."""
        if self.draws is not None and self.skeleton.model.training:
            self.draws.micro_batch = context.index
            self.draws.reseed(unit, self.device)

    def embed(self, params: dict, tokens_BS: torch.Tensor, context: Context) -> torch.Tensor:
        """The first layer's input, from the model's own forward preamble; records the layers' keyword arguments."""
        self._reseed(0, context)
        calls, _ = self.skeleton.capture({**params, **self.base_buffers}, tokens_BS,
                                         context.position_ids[:tokens_BS.shape[0]])
        context.layer_kwargs = [call.kwargs for call in calls]
        return calls[0].hidden

    def embed_backward(self, grads: dict, params: dict, tokens_BS: torch.Tensor, dy_BSH: torch.Tensor,
                       context: Context, cuda: bool) -> None:
        """Add the embedding unit's gradient for output gradient dy_BSH into `grads` (fp32 views of the unit): the
        preamble run again with gradients, a sparse gradient's rows added in place (megatrain.engine.templates.
        add_rows)."""
        leaves = {name: p.detach().requires_grad_() for name, p in params.items()}
        self._reseed(0, context)  # the preamble's draws (an embedding dropout) as its forward drew them
        with torch.enable_grad():
            calls, _ = self.skeleton.capture({**leaves, **self.base_buffers}, tokens_BS,
                                             context.position_ids[:tokens_BS.shape[0]])
            computed = torch.autograd.grad(calls[0].hidden, list(leaves.values()), dy_BSH, allow_unused=True)
        for name, g in zip(leaves, computed, strict=True):
            if g is None:
                continue
            if g.is_sparse:
                add_rows(grads[name], g._indices()[0], g._values(), cuda)
            else:
                grads[name].add_(g)

    def layer(self, unit: Unit, params: dict, x_BSH: torch.Tensor, context: Context) -> torch.Tensor:
        index = unit.index - 1
        template = self.templates[self.skeleton.structure[index]]
        self._reseed(unit.index, context)
        return template.run(index, {**params, **self.layer_buffers[index]}, x_BSH, context.layer_kwargs[index])

    def head_loss(self, params: dict, h_BSH: torch.Tensor, labels_BS: torch.Tensor, normalizer: int) -> torch.Tensor:
        """The final norm, the LM head, the model's logit transform and the cross-entropy, chunked."""
        def chunk_loss(p, h_1TH, labels_T):
            return cross_entropy_sum(head_logits(self.skeleton, {**p, **self.head_buffers}, h_1TH), labels_T,
                                     normalizer)

        return chunked_loss(chunk_loss, params, h_BSH, labels_BS, self.cfg.vocab_size)

    def buffers(self) -> dict[str, torch.Tensor]:
        """The buffers a checkpoint holds (a router's score correction), by full name, on the device."""
        prefix, layers = self.skeleton.base_prefix, self.skeleton.layers_prefix
        found = {}
        for name in self._persistent:
            if name.startswith(layers):
                index, local = name.removeprefix(layers).split(".", 1)
                found[name] = self.layer_buffers[int(index)][local]
            else:
                found[name] = self.base_buffers[name.removeprefix(prefix)]
        return found
