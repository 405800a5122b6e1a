"""A transformers causal LM as parts we stream: built on the meta device, its embedding, decoder layers, final norm
and head found, its layers grouped by structure, its forward preamble captured and its head run from our hidden
states.

Nothing here re-implements a family: the layers are transformers' own modules, whatever a layer needs besides its
hidden state (position embeddings, the mask of its attention type, position ids) is what the model's own forward
passes it (`capture`: the forward runs with every decoder layer replaced by a recorder), and the logits are what the
model's own causal-LM forward makes of the last hidden state (`head_logits`: softcapping, scaling, whatever it does).

State that crosses layers is recorded, not refused (`Crossings`): an input of a layer that the preamble computed from
the embedding unit's weights (Gemma 4's per-layer inputs: its gradient goes back into the preamble), and a mapping
the forward hands every layer, through which a layer publishes tensors that later layers read (Gemma 4's shared KV:
the readers' gradients go back to the publisher); megatrain.engine.programs.generic carries both across the stream.

What the path cannot stream is refused by name (a ValueError saying why): a model whose layers read something
nested in their inputs that was computed from the weights, share state through a cache, are called out of order or
more than once, or whose forward changes the hidden states between layers;
parameters outside the embedding, the layers, the final norm and the head; quantized checkpoints; the router's
load-balancing loss.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from torch import nn
from torch.func import functional_call

from megatrain.models.shape import UnitShapes
from megatrain.models.weights import persistent_buffers


class ConfigJson(Protocol):
    """A model's config.json as the skeleton reads it: megatrain.models.generic.config.GenericConfig, which sits above
    the skeleton (its layout is built here), so the skeleton names it by what it reads and imports it not."""

    @property
    def hf(self) -> Mapping: ...

BASES = ("model", "transformer")  # where causal LMs keep their decoder, when not under their base_model_prefix
LAYER_LISTS = ("layers", "h", "blocks", "decoder.layers")  # where families keep their decoder layers, in the base
FINAL_NORMS = ("norm", "final_layernorm", "ln_f", "final_layer_norm", "norm_f")  # and their final norm
# attributes that differ between layers without making their computation differ: the layer index (transformers reads
# it for the KV cache, which training does not use; a template is given each layer's own before it runs)
PER_LAYER_ATTRIBUTES = ("layer_idx",)


@dataclass(frozen=True)
class Layout:
    """What the meta-device model says of a config: its units, each layer's structure and routed experts."""

    units: tuple[UnitShapes, ...]
    structure: tuple[int, ...]  # per decoder layer, the index of its distinct structure (its template)
    routed: tuple[tuple[str, ...], ...]  # per decoder layer, the names of its routed experts' parameters
    experts: tuple[int, ...]  # per decoder layer, its routed experts (0: a dense layer)
    embedding_name: str  # the input embedding matrix, full name
    head_weight_name: str  # the LM head matrix, full name (the embedding's own when tied)
    vocab_size: int
    hidden_size: int
    buffers: tuple[tuple[str, tuple[int, ...]], ...] = ()  # full name and shape of each buffer a checkpoint holds
    crossing_numel_per_token: int = 0  # elements a token's state crossing layers holds (Crossings) over a step


@dataclass(frozen=True)
class Crossings:
    """What crosses between the layers besides the hidden state, per decoder layer: which of its inputs the preamble
    computed from the embedding unit's weights (positional ones by index among those after the hidden states,
    keyword ones by name), and the names of the keyword inputs that are a mapping every layer is handed, through
    which layers publish tensors to later ones."""

    preamble: tuple[frozenset, ...]
    shared: tuple[frozenset, ...]


class LayerCall(NamedTuple):
    """One decoder layer's call in a captured forward."""

    index: int
    hidden: torch.Tensor
    args: tuple  # positional inputs besides the hidden states
    kwargs: dict


def transformers_config(cfg: ConfigJson):
    """transformers' config object of a GenericConfig (its config class from the config.json dict), with the KV
    cache off; refuses what the generic path does not train."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    hf = cfg.hf
    family = hf.get("model_type")
    if family not in CONFIG_MAPPING:
        # a causal-LM class of transformers' that its architectures name (Kimi K2's names DeepSeek-V3's)
        named = [c for c in hf.get("architectures") or () if c in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()]
        hint = ""
        if named:
            own = getattr(transformers, named[0]).config_class.model_type
            hint = (f"; its architectures name {named[0]}, transformers' class of model_type {own!r}: set model_type "
                    f"to {own!r} if the checkpoint is that architecture")
        raise ValueError(f"model_type {family!r} is not a transformers model (transformers {transformers.__version__})"
                         + hint)
    if family not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"model_type {family!r} has no causal-LM class in transformers {transformers.__version__}")
    if quant := hf.get("quantization_config"):
        raise ValueError(f"quantized checkpoints (quantization_config {quant.get('quant_method')!r}) are not trained "
                         "here: start from the unquantized weights")
    if hf.get("output_router_logits"):
        raise ValueError("the router's load-balancing loss (output_router_logits=true) is not computed by the generic "
                         "path: set output_router_logits to false in config.json")
    try:
        config = CONFIG_MAPPING[family].from_dict(hf)
    except Exception as exc:  # a value its config class refuses (strict dataclass validation, a check of its own)
        raise ValueError(f"transformers refuses this {family} config.json: {_error_line(exc)}") from None
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{family} is an encoder-decoder model; only decoder-only models are trained here")
    config.use_cache = False
    return config


def build_causal_lm(cfg: ConfigJson, device: torch.device | str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """transformers' causal LM of `cfg` built on `device` in `dtype`, in eval mode (no dropout, as from_pretrained
    leaves a model). Its weights are left to the caller (every system initialises them by name, or loads them);
    transformers' initialisation is skipped, as its own DeepSpeed path skips it (it would write into ZeRO-3's empty
    partitions). On the meta device its buffers (rotary frequencies, embedding scales, router biases) are made on the
    CPU and filled by transformers' own initialisation, as from_pretrained fills them."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    config = transformers_config(cfg)
    meta = torch.device(device).type == "meta"
    try:
        with torch.device(device), contextlib.nullcontext() if meta else no_init_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except Exception as exc:  # sizes its modules cannot be built of (a negative width, a head of 0, ...)
        raise ValueError(f"transformers cannot build {config.model_type} from this config.json: "
                         f"{_error_line(exc)}") from None
    if not meta:
        model.tie_weights()  # init_weights ties them, and no_init_weights skipped it
    if meta:
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = torch.empty_like(buffer, device="cpu")
        with torch.device("cpu"):  # what the initialisation computes, on the CPU too (whatever device is default)
            model.initialize_weights()
    return model.eval()


def _error_line(exc: BaseException) -> str:
    """An exception of transformers' on one line: its type and its message's first line."""
    message = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {message[-1].strip() if message else ''}"


class Parts:
    """Where a causal LM keeps the pieces we stream (`model`: meta-device or real).

    Attributes:
        model: the causal LM.
        base, base_prefix: its decoder (model.model) and that name with a dot ('model.').
        layers, layers_prefix: the decoder layers and their list's full name with a dot ('model.layers.').
        norm, norm_prefix: the final norm and its full name with a dot (None, '' where the decoder has none).
        head_weight_name: the LM head matrix's full name ('lm_head.weight'); with tied embeddings the embedding's.
        embedding_name: the input embedding matrix's name in the base ('embed_tokens.weight').
    """

    def __init__(self, model: nn.Module):
        self.model = model
        children = dict(model.named_children())
        prefix = next((n for n in (getattr(model, "base_model_prefix", ""), *BASES) if n in children), None)
        if prefix is None:
            raise ValueError(f"{type(model).__name__} keeps no decoder under {', '.join(BASES)}")
        base = children[prefix]
        self.base, self.base_prefix = base, prefix + "."
        found = next(((name, base.get_submodule(name)) for name in LAYER_LISTS if _has(base, name)), None)
        if found is None or not isinstance(found[1], nn.ModuleList):
            raise ValueError(f"{type(model).__name__} has no list of decoder layers in its decoder "
                             f"(looked for {', '.join(LAYER_LISTS)})")
        self.layers, self.layers_prefix = found[1], f"{self.base_prefix}{found[0]}."
        norm = next((name for name in FINAL_NORMS if _has(base, name)), None)
        self.norm = base.get_submodule(norm) if norm else None
        self.norm_prefix = f"{self.base_prefix}{norm}." if norm else ""
        head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
        if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
            raise ValueError(f"{type(model).__name__} has no LM head matrix")
        names = {id(m): n for n, m in model.named_modules()}
        self.head_weight_name = f"{names[id(head)]}.weight"
        self.embedding_name = f"{names[id(embedding)]}.weight".removeprefix(self.base_prefix)


def _has(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


class Skeleton(Parts):
    """A GenericConfig's causal LM on the meta device (buffers real, on the CPU): the source of its units, its layer
    templates, and the recorder of its forward preamble. Building one checks that the generic path can stream it."""

    def __init__(self, cfg: ConfigJson):
        super().__init__(build_causal_lm(cfg, "meta"))
        self.cfg = cfg
        self.units = self._units()
        self.structure = self._structures()
        self._check_preamble()
        self._check_head()
        self.model.train()  # its modules are the templates that train (dropout as config.json sets it); checked in eval

    # ---- units ----------------------------------------------------------------------------------------------------
    def _units(self) -> tuple[UnitShapes, ...]:
        named = list(self.model.named_parameters())  # tied weights once
        layer_of = {}
        for name, p in named:
            if name.startswith(self.layers_prefix):
                index, local = name.removeprefix(self.layers_prefix).split(".", 1)
                layer_of.setdefault(int(index), []).append((local, tuple(p.shape)))
        head = [(n, tuple(p.shape)) for n, p in named
                if (self.norm_prefix and n.startswith(self.norm_prefix)) or n == self.head_weight_name]
        head += [(n, tuple(p.shape)) for n, p in named if n.startswith(self.head_weight_name.rsplit(".", 1)[0] + ".")
                 and n != self.head_weight_name]  # a head's bias
        embed = [(n.removeprefix(self.base_prefix), tuple(p.shape)) for n, p in named
                 if n.startswith(self.base_prefix) and not n.startswith(self.layers_prefix)
                 and not (self.norm_prefix and n.startswith(self.norm_prefix))]
        counted = {self.base_prefix + n for n, _ in embed} | {n for n, _ in head} | \
            {n for n, _ in named if n.startswith(self.layers_prefix)}
        if outside := [n for n, _ in named if n not in counted]:
            raise ValueError(f"parameters outside the embedding, decoder layers, final norm and LM head are not "
                             f"streamed: {outside[:6]}")
        layers = range(len(self.layers))
        if empty := sorted(set(layers) - set(layer_of)):
            raise ValueError(f"decoder layers without parameters: {empty}")
        return (UnitShapes("embed", self.base_prefix, tuple(embed)),
                *(UnitShapes("layer", f"{self.layers_prefix}{i}.", tuple(layer_of[i])) for i in layers),
                UnitShapes("head", "", tuple(head)))

    def _structures(self) -> tuple[int, ...]:
        """Per layer the index of its structure: layers whose module classes, parameter and buffer shapes and
        settings (every plain attribute but the layer index) agree run one template."""
        keys: dict[tuple, int] = {}
        return tuple(keys.setdefault(structure_key(layer), len(keys)) for layer in self.layers)

    def layout(self) -> Layout:
        embedding = dict(self.units[0].shapes)[self.embedding_name]
        routed = [tuple(n for n, _ in u.shapes if "experts" in n.split(".")) for u in self.units[1:-1]]
        experts = [max((_expert_count(n, dict(u.shapes)[n], names) for n in names), default=0)
                   for u, names in zip(self.units[1:-1], routed, strict=True)]
        return Layout(units=self.units, structure=self.structure, routed=tuple(routed), experts=tuple(experts),
                      embedding_name=self.base_prefix + self.embedding_name,
                      head_weight_name=self.head_weight_name, vocab_size=embedding[0],
                      hidden_size=embedding[1],
                      buffers=tuple((n, tuple(b.shape)) for n, b in persistent_buffers(self.model).items()),
                      crossing_numel_per_token=self.crossing_numel_per_token)

    # ---- the forward preamble -------------------------------------------------------------------------------------
    def capture(self, params: Mapping[str, torch.Tensor], input_ids: torch.Tensor, position_ids: torch.Tensor,
                tuple_outputs: bool | None = None) -> tuple[list[LayerCall], object]:
        """Run the decoder's own forward with `params` (the embedding unit's and the decoder's buffers, names in the
        base), every decoder layer replaced by a recorder that returns its input and the final norm, once every layer
        has run, by the identity: (each layer's call, the decoder's output). tuple_outputs: the recorders return
        (input,), for forwards that index a layer's output (default: as the check found the forward)."""
        calls = []
        tuple_outputs = self.tuple_outputs if tuple_outputs is None else tuple_outputs

        def recorder(index):
            def forward(*args, **kwargs):
                hidden = args[0] if args else kwargs.pop("hidden_states")
                calls.append(LayerCall(index, hidden, args[1:], kwargs))
                return (hidden,) if tuple_outputs else hidden
            return forward

        replaced = {layer: recorder(i) for i, layer in enumerate(self.layers)}
        if self.norm is not None:  # a norm the forward also runs before the layers (nanochat's) runs there
            norm = self.norm.forward
            replaced[self.norm] = lambda x, *a, **k: x if len(calls) == len(self.layers) else norm(x, *a, **k)
        with _forwards(replaced):
            out = functional_call(self.base, dict(params), (), {"input_ids": input_ids, "position_ids": position_ids})
        return calls, out

    def _check_preamble(self) -> None:
        """One capture of a short sequence, the embedding unit's weights requiring gradients: the layers must be
        called once each in order, each on the previous one's output, what their other inputs computed from the
        weights must be whole tensors (recorded in self.crossings with the mappings they share), and the decoder's
        output must be the last one's (the final norm alone between)."""
        params = {local: _zeros_requiring_grad(shape) for local, shape in self.units[0].shapes}
        params.update(self.base_buffers("cpu"))
        ids, positions = torch.zeros(1, 8, dtype=torch.long), torch.arange(8)[None]
        problems, failures = [], []
        for tuple_outputs in (False, True):
            try:
                calls, out = self.capture(params, ids, positions, tuple_outputs)
            except Exception as exc:  # the model's own code, given recorders where it expects its layers
                failures.append(f"its forward does not run with its decoder layers replaced ({type(exc).__name__}: "
                                f"{exc})")
                continue
            problem = _preamble_problem(calls, out, len(self.layers))
            if problem is None:
                self.tuple_outputs = tuple_outputs
                self.crossings = crossings(calls)
                self.crossing_numel_per_token = self._crossing_numel(calls) // ids.numel()
                return
            problems.append(problem)
        raise ValueError((problems or failures)[0])

    def _crossing_numel(self, calls: list[LayerCall]) -> int:
        """Elements of the captured sequence's state crossing layers: its preamble inputs, and what the layers publish
        through shared mappings, found by running them in order, only where they share one."""
        preamble = sum(call.args[k].numel() if isinstance(k, int) else call.kwargs[k].numel()
                       for call, keys in zip(calls, self.crossings.preamble, strict=True) for k in keys)
        if not any(self.crossings.shared):
            return preamble
        try:
            shared = self._published(calls, "meta")
        except Exception:  # an op of the layer reads values (a mixture's routing): zero weights on the CPU
            shared = self._published(calls, "cpu")
        return preamble + sum(t.numel() for mapping in shared.values() for v in mapping.values()
                              for t in ((v,) if isinstance(v, torch.Tensor) else v))

    def _published(self, calls: list[LayerCall], device: str) -> dict[str, dict]:
        """What the layers publish through the mappings they share, each run in order with zero weights on `device`:
        the meta device gives the shapes alone (on the CPU, Gemma-4-31B's 60 layers took minutes: every layer shares
        a mapping, where only two publish)."""
        def moved(x):
            return x.detach().to(device)

        shared: dict[str, dict] = {}
        hidden = moved(calls[0].hidden)
        with torch.no_grad():
            for i, (call, names) in enumerate(zip(calls, self.crossings.shared, strict=True)):
                params = {n: _zeros(tuple(p.shape), device) for n, p in self.layers[i].named_parameters()}
                args, kwargs = _map_tensors((call.args, call.kwargs), moved)
                out = functional_call(self.layers[i], {**params, **self.layer_buffers(i, device)}, (hidden, *args),
                                      {**kwargs, **{n: shared.setdefault(n, {}) for n in names}})
                hidden = out[0] if isinstance(out, tuple) else out
        return shared

    def base_buffers(self, device: torch.device | str) -> dict[str, torch.Tensor]:
        """The decoder's buffers outside its layers (rotary frequencies, an embedding scale), names in the base."""
        return {n: b.to(device) for n, b in self.base.named_buffers()
                if not (self.base_prefix + n).startswith(self.layers_prefix)}

    def layer_buffers(self, index: int, device: torch.device | str) -> dict[str, torch.Tensor]:
        """Decoder layer `index`'s buffers (a router's score correction, ...), names in the layer."""
        return {n: b.to(device) for n, b in self.layers[index].named_buffers()}

    # ---- the head -------------------------------------------------------------------------------------------------
    def _check_head(self) -> None:
        """The causal LM's own forward makes logits of the last hidden states alone: on the meta device (a real
        vocabulary-wide GEMM took ~0.8 s a large model), else, where the family's head code does not run there, on
        zeros on the CPU, whose failure is the refusal."""
        shapes = dict(self.units[-1].shapes)
        vocab, hidden = dict(self.units[0].shapes)[self.embedding_name]
        if self.head_weight_name not in shapes:  # tied: the embedding's
            shapes[self.head_weight_name] = (vocab, hidden)
        try:
            logits = head_logits(self, {n: torch.empty(s, device="meta") for n, s in shapes.items()},
                                 torch.empty(1, 2, hidden, device="meta"))
        except Exception:
            head = {n: torch.zeros(1, *s[1:]).expand(s) if len(s) >= 2 else torch.zeros(s) for n, s in shapes.items()}
            try:
                logits = head_logits(self, head, torch.zeros(1, 2, hidden))
            except Exception as exc:  # the model's own code, given the last hidden states alone
                raise ValueError(f"its causal-LM forward reads more of the decoder's output than its last hidden "
                                 f"states ({type(exc).__name__}: {exc}), state shared between layers") from None
        if logits is None or logits.shape[:2] != (1, 2):
            raise ValueError("its causal-LM forward returns no logits for every position")


def head_logits(parts: Parts, params: Mapping[str, torch.Tensor], h_1TH: torch.Tensor,
                final_norm: bool = True) -> torch.Tensor:
    """The logits [1, T, V] the causal LM's own forward makes of hidden states h_1TH: the final norm (with
    final_norm), the LM head, and whatever the family does to the logits; `params` the head's (names from the
    causal LM, the tied head's matrix under the head's own name), the rest of the model not run."""
    def decoder_output(*args, **kwargs):
        h = parts.norm(h_1TH) if final_norm and parts.norm is not None else h_1TH
        return _decoder_output_class()(last_hidden_state=h)

    ids = torch.zeros(h_1TH.shape[:2], dtype=torch.long, device=h_1TH.device)
    with _forwards({parts.base: decoder_output}):
        return functional_call(parts.model, dict(params), (), {"input_ids": ids}).logits


@functools.cache
def _decoder_output_class():
    from transformers.modeling_outputs import MoeModelOutputWithPast

    class DecoderOutput(MoeModelOutputWithPast):
        """The decoder's output as the head sees it: the last hidden states, and None for any other output a family's
        forward passes along without using (Gemma 4's shared_kv_states, returned only on request)."""

        def __getattr__(self, name):
            if name.startswith("_"):
                raise AttributeError(name)
            return None

    return DecoderOutput


def _preamble_problem(calls: list[LayerCall], out, num_layers: int) -> str | None:
    """Why a captured preamble cannot be streamed, or None."""
    from transformers import Cache

    order = [index for index, *_ in calls]
    if order != list(range(num_layers)):
        return f"its forward calls the decoder layers in the order {order}, not each once in order"
    for i, (_, hidden, args, kwargs) in enumerate(calls):
        inputs = {**{f"positional input {j + 1}": a for j, a in enumerate(args)}, **kwargs}
        if cached := [k for k, v in inputs.items() if isinstance(v, Cache)]:
            return f"its decoder layers share state through a cache ({', '.join(cached)}), not a mapping of tensors"
        # a tensor the preamble computed from the weights is carried whole (Crossings); one nested in an input is not
        if nested := [k for k, v in inputs.items() if not _from_preamble(v) and _any_tensor(v, _requires_grad)]:
            return (f"its decoder layers read inputs computed from the weights nested in other inputs "
                    f"({', '.join(nested)})")
        # a positional None carries nothing (Gemma 4's per-layer input where its config has none): replayed as is
        if plain := [a for a in args if a is not None and not _from_preamble(a)]:
            return f"its forward passes decoder layer {i} {len(plain)} positional inputs besides the hidden states"
        if not _whole_view(hidden, calls[max(i - 1, 0)][1]):
            return f"its forward changes the hidden states between decoder layers {i - 1} and {i}"
    last = getattr(out, "last_hidden_state", None)
    if last is not calls[-1][1]:
        return "its forward changes the last layer's output other than by the final norm"
    return None


def _whole_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` is `b` or a view of all of it (Gemma 4 slices the hidden states to the positions it keeps logits
    of, all of them in training, before its KV-sharing layers)."""
    return a is b or (a.shape == b.shape and a.stride() == b.stride() and a.data_ptr() == b.data_ptr()
                      and a.storage_offset() == b.storage_offset())


def crossings(calls: list[LayerCall]) -> Crossings:
    """The state crossing layers in a captured forward (one whose embedding unit's weights required gradients)."""
    from transformers import Cache

    preamble = [frozenset([*(j for j, a in enumerate(args) if _from_preamble(a)),
                           *(k for k, v in kwargs.items() if _from_preamble(v))]) for _, _, args, kwargs in calls]
    shared = [frozenset(k for k, v in kwargs.items() if isinstance(v, MutableMapping) and not isinstance(v, Cache))
              for _, _, _, kwargs in calls]
    return Crossings(tuple(preamble), tuple(shared))


def _from_preamble(value) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad


def structure_key(layer: nn.Module) -> tuple:
    """What makes two decoder layers compute alike: module classes, parameter and buffer shapes and dtypes, and
    every plain setting (numbers, strings, flags) of every submodule but PER_LAYER_ATTRIBUTES."""
    key = []
    for name, module in layer.named_modules():
        settings = tuple(sorted((k, _hashable(v)) for k, v in vars(module).items()
                                if not k.startswith("_") and k not in ("training", *PER_LAYER_ATTRIBUTES)
                                and _plain(v)))
        tensors = tuple((n, tuple(t.shape), t.dtype) for n, t in
                        [*module._parameters.items(), *module._buffers.items()] if t is not None)
        key.append((name, type(module).__qualname__, settings, tensors))
    return tuple(key)


def _hashable(value):
    """A plain setting as a key: lists as tuples."""
    return tuple(_hashable(v) for v in value) if isinstance(value, (tuple, list)) else value


def _plain(value) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def _expert_count(name: str, shape: tuple[int, ...], names: tuple[str, ...]) -> int:
    """Experts of a routed parameter: its first dimension when stacked, else the experts' list length."""
    parts = name.split(".")
    after = parts[parts.index("experts") + 1]
    if after.isdigit():
        return len({n.split(".")[n.split(".").index("experts") + 1] for n in names})
    return shape[0] if len(shape) >= 3 else 1


def _zeros(shape: tuple[int, ...], device: str) -> torch.Tensor:
    """Zeros of `shape` on `device`: one row's memory on the CPU; on the meta device, none."""
    if device == "meta":
        return torch.empty(shape, device="meta")
    return torch.zeros(1, *shape[1:]).expand(shape) if len(shape) >= 2 else torch.zeros(shape)


def _zeros_requiring_grad(shape: tuple[int, ...]) -> torch.Tensor:
    """Zeros of `shape` that require gradients, one row's memory (a vocabulary-sized embedding costs nothing)."""
    if not shape:
        return torch.zeros((), requires_grad=True)
    return torch.zeros(1, *shape[1:], requires_grad=True).expand(shape)


def _requires_grad(t: torch.Tensor) -> bool:
    return t.requires_grad


def _map_tensors(value, fn: Callable[[torch.Tensor], torch.Tensor]):
    """`value` with fn applied to every tensor in it, through tuples, lists and dicts."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_map_tensors(v, fn) for v in value)
    if type(value) is dict:
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    return value


def _any_tensor(value, test: Callable[[torch.Tensor], bool]) -> bool:
    if isinstance(value, torch.Tensor):
        return test(value)
    if isinstance(value, (tuple, list)):
        return any(_any_tensor(v, test) for v in value)
    if isinstance(value, dict):
        return any(_any_tensor(v, test) for v in value.values())
    return False


@contextlib.contextmanager
def _forwards(replacements: Mapping[nn.Module, Callable]):
    """Modules' forwards replaced (instance attributes) for the block, restored after."""
    for module, forward in replacements.items():
        module.forward = forward
    try:
        yield
    finally:
        for module in replacements:
            del module.forward
