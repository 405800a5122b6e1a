"""A generic model's checkpoints, read and written by transformers itself: whatever layout a family publishes (experts
one by one or fused, renamed keys) is transformers' conversion to and from its modules, not ours.

Checking holds the files' headers to the model where transformers would rename nothing: a tensor of the model's own
name stored in another shape, or stored as other than floating point, is refused, and where every stored key is one of
the model's names, each weight missing. Reading loads the checkpoint with from_pretrained on the host (its
safetensors only, in its stored dtype) and refuses what transformers' own loading report finds missing, unexpected or
of another shape (which transformers would initialise at random or ignore); then hands the weights over one at a time:
the host holds that copy of the model beside the training state while it loads. Writing is save_pretrained of the same
class, from the weights by name, with the config.json the model was read from.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from megatrain.models.generic.config import GenericConfig
from megatrain.models.generic.skeleton import build_causal_lm, transformers_config
from megatrain.models.safetensors_files import Stored
from megatrain.models.weights import named_weights, persistent_buffers

EXPERT_KEY = re.compile(r"(.*\.experts\.)(\d+)\.(.+)")  # a routed expert's tensor stored one expert per key


def check_weights(cfg: GenericConfig, path: Path, stored: Stored) -> None:
    """The headers of the checkpoint in folder `path` (`stored`) held to the model as far as they tell without
    transformers' renaming; ValueError naming the first tensor that is not as the model needs it."""
    for key, tensor in stored.items():
        if not tensor.dtype.is_floating_point:
            raise ValueError(f"{tensor.file}: {key} is stored as {str(tensor.dtype).removeprefix('torch.')}: weights "
                             "are floating point")
    expected = {unit.prefix + name: shape for unit in cfg.unit_shapes() for name, shape in unit.shapes}
    expected.update(cfg.layout.buffers)
    for key in stored:
        if key in expected and stored[key].shape != expected[key]:
            raise ValueError(f"{stored[key].file}: {key} has shape {stored[key].shape}, the config implies "
                             f"{expected[key]}")
    _check_experts(cfg, stored)
    ignored = {cfg.layout.head_weight_name} if cfg.tie_embeddings else set()
    if all(key in expected or key in ignored or key.endswith("rotary_emb.inv_freq") for key in stored):
        # stored under the model's own names: nothing is renamed, so what is not there is missing
        if missing := sorted(expected.keys() - stored.keys()):
            raise ValueError(f"the checkpoint lacks tensor {missing[0]!r}" + (f" ({len(missing) - 1} more)"
                                                                              if len(missing) > 1 else ""))


def _check_experts(cfg: GenericConfig, stored: Stored) -> None:
    """Experts stored one per key (`...experts.N.NAME`, as Mixtral publishes them, which transformers stacks into one
    tensor as it loads): under each prefix, every expert of the config's count (a layer's routed experts) with the
    same names, each name of one shape. ValueError naming the first tensor missing, extra or misshapen."""
    groups: dict[str, dict[str, dict[int, str]]] = {}  # prefix -> name -> expert -> key
    for key in stored:
        if found := EXPERT_KEY.fullmatch(key):
            groups.setdefault(found[1], {}).setdefault(found[3], {})[int(found[2])] = key
    counts = sorted(set(cfg.layout.experts) - {0})
    for prefix, names in sorted(groups.items()):
        experts = sorted(set().union(*names.values()))
        if experts != list(range(len(experts))) or len(experts) not in counts:
            raise ValueError(f"the checkpoint stores experts {_spans(experts)} under {prefix}N, and the config's "
                             f"layers have {' or '.join(map(str, counts))} experts (0 to "
                             f"{counts[-1] - 1 if counts else -1})")
        for name, keys in sorted(names.items()):
            if missing := [e for e in experts if e not in keys]:
                raise ValueError(f"the checkpoint lacks tensor {prefix}{missing[0]}.{name}, which the other experts "
                                 "under it have")
            shapes = [stored[keys[e]].shape for e in experts]
            common = max(set(shapes), key=shapes.count)
            odd = next((e for e in experts if shapes[e] != common), None)
            if odd is not None:
                raise ValueError(f"{stored[keys[odd]].file}: {keys[odd]} has shape {shapes[odd]}, the other experts' "
                                 f"{name} {common}")


def _spans(numbers: list[int]) -> str:
    """0-2, 4 of [0, 1, 2, 4]."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][-1] + 1:
            spans[-1].append(n)
        else:
            spans.append([n])
    return ", ".join(f"{s[0]}-{s[-1]}" if len(s) > 1 else str(s[0]) for s in spans)


def read_weights(cfg: GenericConfig, path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every parameter and persistent buffer of the checkpoint in folder `path`, as transformers
    loads it (from_pretrained on the host, safetensors only); ValueError naming what transformers' loading report
    finds missing, unexpected or of another shape."""
    from transformers import AutoModelForCausalLM

    with _quiet():
        try:
            model, report = AutoModelForCausalLM.from_pretrained(
                path, config=transformers_config(cfg), dtype="auto", use_safetensors=True, output_loading_info=True,
                ignore_mismatched_sizes=True)  # reported below, rather than raised as a RuntimeError
        except RuntimeError as exc:  # what its conversion of the stored tensors to its modules could not do
            raise ValueError(f"{path}: transformers cannot load the checkpoint's tensors into its model "
                             f"({str(exc).splitlines()[0]})") from None
    problems = [f"lacks tensor {key!r}" for key in sorted(report.get("missing_keys") or ())]
    problems += [f"holds tensor {key!r}, which the model does not have" for key in
                 sorted(report.get("unexpected_keys") or ())]
    problems += [f"stores {key!r} as {tuple(stored)}, the model's is {tuple(own)}" for key, stored, own in
                 sorted(report.get("mismatched_keys") or ())]
    if problems:
        raise ValueError(f"{path}: the checkpoint {problems[0]}"
                         + (f" ({len(problems) - 1} more problems)" if len(problems) > 1 else ""))
    weights = named_weights(model)
    del model
    for name in list(weights):  # each released once the caller has copied it
        yield name, weights.pop(name)


@torch.no_grad()
def write_weights(weights: Mapping[str, torch.Tensor], cfg: GenericConfig, out_dir: Path, max_shard_bytes: int,
                  dtype: torch.dtype) -> None:
    """Write `weights` (every parameter and persistent buffer by name) as the family's own checkpoint: transformers'
    save_pretrained of the same class, with its rendering of the config.json `cfg` was read from; the parameters in
    `dtype`, the buffers in their own."""
    model = build_causal_lm(cfg, "meta")
    buffers = persistent_buffers(model)
    expected = named_weights(model)
    if missing := sorted(set(expected) - set(weights)):
        raise ValueError(f"weights missing for the export: {missing[:8]}")
    state = {name: weights[name].detach().to("cpu", None if name in buffers else dtype) for name in expected}
    model.config.dtype = dtype
    with _quiet():
        model.save_pretrained(out_dir, state_dict=state, max_shard_size=max_shard_bytes, safe_serialization=True)


@contextlib.contextmanager
def _quiet():
    """transformers' progress bars and its loading report off (a train run logs its own lines, and a report that
    finds a problem is refused in one line), as they were after."""
    from transformers.utils import logging

    was, verbosity = logging.is_progress_bar_enabled(), logging.get_verbosity()
    logging.disable_progress_bar()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if was:
            logging.enable_progress_bar()
