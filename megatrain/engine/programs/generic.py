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

State crossing layers (Skeleton.crossings): an input the preamble computed from the embedding unit's weights (Gemma
4's per-layer inputs) is replayed like the others, and in backward passes through a tap (`_Tap`) whose backward adds
the layer's gradient for it to the micro-batch's context; the embedding unit's backward sends those gradients into
the preamble with the first layer's. A mapping handed to every layer (Gemma 4's shared KV) is replaced by the
context's own (`Published`): forward keeps what a layer publishes, readers get it back (tapped in backward before
the layer's call, their gradients summed per name), and a publisher's recompute hands its published tensors the
readers' sum through its output (`_Inject`), so that the schedule's one autograd call per layer backpropagates both;
each layer runs backward after every later one, so every reader's gradient is in before its publisher's backward.
The schedule is unchanged.

The templates train in train mode (dropout and router jitter as config.json sets them, each unit's forward of a
micro-batch drawing from its own seed: megatrain.models.draws), the held-out loss runs in eval mode.

Packed rows pass per-document position ids, from which transformers builds document masks (models.generic.module.
position_ids; a model with layers other than attention is refused packed rows).
"""

from __future__ import annotations

import functools
import sys
import types
from collections import UserDict
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.func import functional_call

from megatrain.engine.layout import Unit
from megatrain.engine.programs import AuxLoss
from megatrain.engine.templates import CompiledCall, add_rows
from megatrain.models.draws import Draws
from megatrain.models.generic.config import GenericConfig
from megatrain.models.generic.head import chunked_loss, cross_entropy_sum
from megatrain.models.generic.module import GenericCausalLM, checkpointed, position_ids
from megatrain.models.generic.skeleton import PER_LAYER_ATTRIBUTES, Skeleton, head_logits
from megatrain.models.weights import persistent_buffers


@dataclass
class Context:
    """What one micro-batch's layers need besides their input: its position ids, and once the embedding has run,
    the keyword arguments the model's layer loop passes each layer."""

    position_ids: torch.Tensor  # [B, S]
    layer_args: list[tuple] = field(default_factory=list)  # positional inputs besides the hidden states
    index: int = 0  # the micro-batch's, in this process's step (its draws' seeds: megatrain.models.draws)
    layer_kwargs: list[dict] = field(default_factory=list)
    published: dict = field(default_factory=dict)  # (mapping input, key) -> what a layer published there
    published_grads: dict = field(default_factory=dict)  # (mapping input, key) -> its readers' summed gradients
    preamble_grads: dict = field(default_factory=dict)  # (layer, input) -> the layer's gradient for a preamble input


def _accumulate(grads: dict, key, values: tuple) -> None:
    """Add the gradients `values` (a tuple, None where none came) into grads[key]."""
    old = grads.get(key, (None,) * len(values))
    grads[key] = tuple(o if g is None else g if o is None else o + g for o, g in zip(old, values, strict=True))


class _Tap(torch.autograd.Function):
    """The identity on `values` in forward, with the layer's input x_BSH as an input only so that backward runs
    (the schedule asks for the input's and the weights' gradients); backward adds the gradients of `values` into
    grads[key] and passes none on."""

    @staticmethod
    def forward(ctx, x_BSH, grads, key, *values):
        ctx.grads, ctx.key = grads, key
        return tuple(v.view_as(v) for v in values)

    @staticmethod
    def backward(ctx, *dvalues):
        _accumulate(ctx.grads, ctx.key, dvalues)
        return (None,) * (3 + len(dvalues))


class _Inject(torch.autograd.Function):
    """The identity on the layer's output y_BSH in forward; backward also gives the tensors the layer published
    (`published`, flat) their readers' summed gradients (`dpublished`)."""

    @staticmethod
    def forward(ctx, y_BSH, dpublished, *published):
        ctx.dpublished = dpublished
        return y_BSH.view_as(y_BSH)

    @staticmethod
    def backward(ctx, dy_BSH):
        return (dy_BSH, None, *ctx.dpublished)


class Published(UserDict):
    """The mapping a layer is handed in place of the one its model's forward shares between layers: reads and
    writes go to the micro-batch's context under (`name`, key). With gradients off (forward) a write is kept for the
    readers and a read returns it; with gradients on (a layer's recompute in backward) a read returns the value tapped
    (_Tap) before the layer ran, and a write is remembered, for _Inject. The taps are made outside the layer's call
    (every value published under `name` so far: a tap the layer does not read never runs backward), so that a compiled
    layer reads a dict: a tap inside it is an autograd function mutating the context's gradients, which Dynamo cannot
    trace (a graph break in each of Gemma-4-E4B's layers that read another's keys and values)."""

    def __init__(self, name: str, context: Context, x_BSH: torch.Tensor):
        super().__init__()
        self.name, self.context, self.written = name, context, []
        self.tapped = {}
        if torch.is_grad_enabled():
            for (name_, key), value in context.published.items():
                if name_ == name:
                    flat = _Tap.apply(x_BSH, context.published_grads, (name, key), *_flat(value))
                    self.tapped[key] = flat[0] if isinstance(value, torch.Tensor) else type(value)(flat)

    def __getitem__(self, key):
        if torch.is_grad_enabled():
            return self.tapped[key]
        return self.context.published[self.name, key]

    def __setitem__(self, key, value):
        if torch.is_grad_enabled():
            self.written.append(((self.name, key), _flat(value)))
        else:
            self.context.published[self.name, key] = value

    def __contains__(self, key):
        return (self.name, key) in self.context.published


def _flat(value) -> tuple[torch.Tensor, ...]:
    return (value,) if isinstance(value, torch.Tensor) else tuple(value)


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

    def _layer(self, params: dict, x_BSH: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        out = functional_call(self.module, params, (x_BSH, *args), kwargs)
        return out[0] if isinstance(out, tuple) else out

    def run(self, index: int, params: dict, x_BSH: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        for m in self.indexed:  # the layer's own index, where transformers keeps one
            for attribute in PER_LAYER_ATTRIBUTES:
                if hasattr(m, attribute):
                    setattr(m, attribute, index)
        return self(params, x_BSH, args, kwargs)


# The compiled templates of this process, by (config.json, layer structure, micro-batch, sequence, dtype, device): a
# program built again of what an earlier one was (an engine rebuilt, a sweep's next case, the GPU suite's next set)
# runs the graphs the first compiled. A template of its own traced and compiled transformers' modules again each build:
# the engine's compiled builds were 2 935 s of the GPU suite's 4 018 timed at d0c54b8, its tiny generic models ~2 000
# of them. The shapes and dtype in the key keep one template's graphs to those one program makes (Dynamo's recompile
# limit counts per template). Eager templates stay each program's own.
_COMPILED: dict[tuple, ModuleTemplate] = {}


def _template(key: tuple, module: nn.Module, compile_layer: bool) -> ModuleTemplate:
    """The layer template of `module` (a program's skeleton layer of the structure `key` names): compiled, the one
    this process holds for `key` (its module another program's skeleton layer, alike by the key); eager, its own."""
    if not compile_layer:
        return ModuleTemplate(module, compile_layer=False)
    if key not in _COMPILED:
        _COMPILED[key] = ModuleTemplate(module, compile_layer=True)
    return _COMPILED[key]


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
        if config.options.forward_graph != "no-grad":
            raise ValueError(f"option forward_graph=training runs a hand-written model's layers; {cfg.family} runs "
                             "through transformers' own modules, whose forward keeps what later layers read with "
                             "gradients off: leave it 'no-grad'")
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
        # a layer's floating buffers in the compute dtype, as transformers loads a model in bf16 (from_pretrained's
        # dtype), but those its class keeps in fp32 (DeepSeek-V3's router correction): the layer computes in that
        # dtype with no autocast, and MiniMax's decay buffers meet bf16 activations in a matmul
        keep = [*(getattr(skeleton.model, "_keep_in_fp32_modules", None) or ()),
                *(getattr(skeleton.model, "_keep_in_fp32_modules_strict", None) or ())]

        def computed(name: str, buffer: torch.Tensor) -> torch.Tensor:
            if not buffer.is_floating_point() or any(k in name for k in keep):
                return buffer
            return buffer.to(config.torch_dtype)

        self.layer_buffers = [{n: computed(n, b) for n, b in skeleton.layer_buffers(i, device).items()}
                              for i in range(cfg.num_layers)]
        self._persistent = list(persistent_buffers(skeleton.model))
        first = {}
        for i, s in enumerate(skeleton.structure):
            first.setdefault(s, i)
        self.templates = {s: _template((cfg.hf_json, s, config.micro_batch, config.seq, str(config.torch_dtype),
                                        device.type), skeleton.layers[i], config.compile) for s, i in first.items()}
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
        return [Context(positions[i:i + self.micro_batch], index=i // self.micro_batch)
                for i in range(0, positions.shape[0], self.micro_batch)]

    def train(self, mode: bool) -> None:
        """Train mode (dropout and jitter as config.json sets them) or eval mode (a held-out loss) for every
        template (a compiled one may be another program's module: _template) and the preamble."""
        self.skeleton.model.train(mode)
        for template in self.templates.values():
            template.module.train(mode)

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
        context.layer_args = [call.args for call in calls]
        context.layer_kwargs = [call.kwargs for call in calls]
        context.published, context.published_grads, context.preamble_grads = {}, {}, {}
        return calls[0].hidden

    def embed_backward(self, grads: dict, params: dict, tokens_BS: torch.Tensor, dy_BSH: torch.Tensor,
                       context: Context, cuda: bool) -> None:
        """Add the embedding unit's gradient for output gradient dy_BSH into `grads` (fp32 views of the unit): the
        preamble run again with gradients, from the first layer's input and every layer's input it computed (their
        gradients gathered in the layers' backward), a sparse gradient's rows added in place (megatrain.engine.
        templates.add_rows)."""
        leaves = {name: p.detach().requires_grad_() for name, p in params.items()}
        self._reseed(0, context)  # the preamble's draws (an embedding dropout) as its forward drew them
        with torch.enable_grad():
            calls, _ = self.skeleton.capture({**leaves, **self.base_buffers}, tokens_BS,
                                             context.position_ids[:tokens_BS.shape[0]])
            outputs, output_grads = [calls[0].hidden], [dy_BSH]
            for (index, key), (g,) in context.preamble_grads.items():
                if g is not None:
                    _, _, args, kwargs = calls[index]
                    outputs.append(args[key] if isinstance(key, int) else kwargs[key])
                    output_grads.append(g)
            context.preamble_grads = {}
            computed = torch.autograd.grad(outputs, list(leaves.values()), output_grads, allow_unused=True)
        for name, g in zip(leaves, computed, strict=True):
            if g is None:
                continue
            if g.is_sparse:
                add_rows(grads[name], g._indices()[0], g._values(), cuda)
            else:
                grads[name].add_(g)

    def layer(self, unit: Unit, params: dict, x_BSH: torch.Tensor, context: Context, routing=None) -> torch.Tensor:
        """Decoder-layer unit `unit`'s output; with gradients on (its recompute in backward), the inputs crossing from
        the preamble and other layers tapped, and what it published given its readers' gradients. `routing` is always
        None: transformers' modules take no routing to replay (AuxLoss)."""
        index = unit.index - 1
        template = self.templates[self.skeleton.structure[index]]
        self._reseed(unit.index, context)
        args, kwargs = context.layer_args[index], context.layer_kwargs[index]
        crossings = self.skeleton.crossings
        if torch.is_grad_enabled() and crossings.preamble[index]:
            keys = sorted(crossings.preamble[index], key=str)
            values = [args[k] if isinstance(k, int) else kwargs[k] for k in keys]
            tapped = dict(zip(keys, (_Tap.apply(x_BSH, context.preamble_grads, (index, k), v)[0]
                                     for k, v in zip(keys, values, strict=True)), strict=True))
            args = tuple(tapped.get(j, a) for j, a in enumerate(args))
            kwargs = {k: tapped.get(k, v) for k, v in kwargs.items()}
        shared = {name: Published(name, context, x_BSH) for name in crossings.shared[index]}
        y_BSH = template.run(index, {**params, **self.layer_buffers[index]}, x_BSH, args, {**kwargs, **shared})
        written = [w for mapping in shared.values() for w in mapping.written]
        if not written:
            return y_BSH
        tensors, dtensors = [], []
        for key, values in written:  # the readers' gradients, taken: this is the publisher's one backward
            summed = context.published_grads.pop(key, (None,) * len(values))
            context.published.pop(key, None)
            tensors += values
            dtensors += summed
        return _Inject.apply(y_BSH, tuple(dtensors), *tensors)

    def hidden(self, y: torch.Tensor) -> torch.Tensor:
        """A layer's output is its hidden states alone."""
        return y

    def aux_loss(self, tokens: list[torch.Tensor], world: int) -> AuxLoss:
        """Nothing besides the cross-entropy: transformers' own routers' auxiliary losses are refused (models.generic.
        skeleton)."""
        return AuxLoss()

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


def compile_module_layers(model: GenericCausalLM) -> list[ModuleTemplate]:
    """Every decoder layer of `model` run through its structure's compiled template (one per distinct layer
    structure) with its own parameters and buffers, each layer still checkpointed (a system that owns the module
    compiles as the engine does: DeepSpeed ZeRO-3); returns the templates."""
    skeleton, templates = Skeleton(model.cfg), {}
    for i, (layer, structure) in enumerate(zip(model.layers, skeleton.structure, strict=True)):
        if structure not in templates:
            templates[structure] = ModuleTemplate(skeleton.layers[i], compile_layer=True)
        layer.forward = functools.partial(checkpointed, functools.partial(_module_through, templates[structure], i,
                                                                          layer))
    return list(templates.values())


def _module_through(template: ModuleTemplate, index: int, layer: nn.Module, hidden_states: torch.Tensor, *args,
                    **kwargs):
    """A transformers decoder layer's forward: its structure's template with the layer's own (under ZeRO-3: gathered)
    parameters and buffers (and its positional inputs, Gemma 4's per-layer input)."""
    if template.module.training != layer.training:  # the template draws (dropout) as the layer it runs for would
        template.module.train(layer.training)
    return template.run(index, {**dict(layer.named_parameters()), **dict(layer.named_buffers())}, hidden_states,
                        args, kwargs)
