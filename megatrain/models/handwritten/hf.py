"""The hand-written families' Hugging Face checkpoints: config.json translated to ModelConfig and back, and their
tensors in and out of our names (megatrain.models.checkpoint is the road that reaches them).

Our parameter names are HF's without the `model.` prefix (`lm_head.weight` is the same in both), so translation is a
prefix, except for the experts: a layer's experts are two stacked tensors of ours ([E, 2I, H] gate rows then up rows,
[E, H, I]), which Qwen3-MoE stores expert by expert (`experts.{e}.gate_proj.weight`, 5.x's fused [E, 2I, H] also
read) under a router named `gate`, and GPT-OSS as [E, H, 2I] with gate and up columns interleaved and [E, I, H], in
bf16 or as MXFP4 blocks (dequantized on load); exports are written in each family's published layout, bf16 experts
for GPT-OSS. Configs are read in both the transformers 4.x layout (rope_theta, rope_scaling) and the 5.x
one (rope_parameters) and written in both; a setting that needs code we do not have (another activation, partial or
per-layer RoPE, longrope, ...) is refused by name, never approximated.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from megatrain.models.draws import random_settings
from megatrain.models.handwritten.config import ModelConfig
from megatrain.models.handwritten.families import ALL, ALTERNATE, FAMILIES, MOE_FAMILIES, NONE, ROWS, SUFFIX
from megatrain.models.masks import FULL, SLIDING
from megatrain.models.rope import RopeScaling
from megatrain.models.safetensors_files import (
    INDEX_FILE,
    SINGLE_FILE,
    Stored,
    Tensors,
    plan_shards,
    save_shard,
    shard_names,
    stored_tensors,
)

# the keys each RoPE scaling reads (transformers' modeling_rope_utils); another key is refused, not ignored
_ROPE_KEYS = {"default": set(), "linear": {"factor"}, "dynamic": {"factor"},
              "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
              "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor",
                       "mscale", "mscale_all_dim", "truncate"}}
# the keys that give a hand-written family's shape: a config.json without one is damaged (transformers' defaults
# are not a shape)
REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def hf_name(name: str) -> str:
    return name if name == "lm_head.weight" else "model." + name


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _rope_from_hf(hf: Mapping) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) of a config: 5.x's rope_parameters or 4.x's rope_theta and rope_scaling."""
    params = dict(hf.get("rope_parameters") or {})
    family = ROWS.get(hf.get("model_type"))
    if not params and not hf.get("rope_scaling") and family is not None and "rope" in family.defaults:
        params = {**family.defaults["rope"], **{k: hf[k] for k in ("rope_theta",) if k in hf}}
    if any(isinstance(v, Mapping) for v in params.values()):
        raise ValueError(f"per-layer rope_parameters ({sorted(params)}) are not supported; one RoPE for every layer")
    legacy = dict(hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope = params if params.get("rope_type", params.get("type", "default")) != "default" or not legacy else legacy
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))  # both keys popped: 4.x wrote either
    rope.pop("rope_theta", None)
    factor = rope.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if factor != 1.0:
        raise ValueError(f"partial_rotary_factor={factor} is not supported; our RoPE rotates the whole head")
    if rope_type not in _ROPE_KEYS:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(_ROPE_KEYS)}")
    if unknown := sorted(set(rope) - _ROPE_KEYS[rope_type]):
        raise ValueError(f"RoPE setting(s) {unknown} are not used by rope_type {rope_type!r}; remove them")
    if rope_type == "default":
        return theta, None
    max_positions = hf.get("max_position_embeddings")
    if rope_type in ("llama3", "yarn"):  # transformers prefers a top-level original_max_position_embeddings
        rope["original_max_position_embeddings"] = hf.get("original_max_position_embeddings",
                                                          rope.get("original_max_position_embeddings", max_positions))
    if rope.get("factor") is None and rope_type == "yarn" and max_positions:
        rope["factor"] = max_positions / rope["original_max_position_embeddings"]
    if rope.get("factor") is None:
        raise ValueError(f"rope_type {rope_type!r} needs a factor")
    rope["original_max_positions"] = rope.pop("original_max_position_embeddings", 0) or 0
    for key in ("beta_fast", "beta_slow"):  # transformers: None means the paper's 32 and 1
        if key in rope and rope[key] is None:
            del rope[key]
    return theta, RopeScaling(rope_type, **rope)


def _attention_layers(hf: Mapping, family: str, num_layers: int) -> tuple[int, tuple[str, ...]]:
    """(sliding window, per-layer types) as transformers builds them for the family."""
    defaults = ROWS[family].defaults
    types = tuple(hf.get("layer_types") or ())
    if unknown := sorted(set(types) - {FULL, SLIDING}):
        raise ValueError(f"layer_types {unknown} are not supported; only {FULL!r} and {SLIDING!r} are")
    windows = ROWS[family].windows
    if windows == NONE:  # transformers' Llama would ignore them: refused rather than trained differently
        if SLIDING in types:
            raise ValueError(f"{family} models have no sliding-window attention; the config's layer_types ask for it")
        if hf.get("use_sliding_window"):
            raise ValueError(f"{family} with use_sliding_window=true is not supported (no released checkpoint uses "
                             "it); set it false")
        window, types = 0, ()
    elif windows == ALTERNATE:  # transformers' default: even layers slide, odd ones attend fully
        window = hf.get("sliding_window", defaults["sliding_window"]) or 0
        types = types or tuple(SLIDING if n % 2 == 0 else FULL for n in range(num_layers))
    elif windows == ALL:
        if any(t != FULL for t in types):
            raise ValueError(f"mistral with layer_types {sorted(set(types))} is not supported (transformers builds it "
                             "as Ministral)")
        window = hf.get("sliding_window", defaults["sliding_window"]) or 0
        types = (SLIDING,) * num_layers if window else ()
    else:  # suffix: the layers from max_window_layers on slide when use_sliding_window
        window = (hf.get("sliding_window") or 0) if hf.get("use_sliding_window") else 0
        if not types:
            first = hf.get("max_window_layers", defaults["max_window_layers"])
            types = tuple(SLIDING if window and n >= first else FULL for n in range(num_layers))
    if types and SLIDING not in types:
        types, window = (), 0
    if SLIDING in types and not window:
        raise ValueError("layer_types has sliding_attention layers but the config has no sliding_window "
                         f"(use_sliding_window={hf.get('use_sliding_window')}, "
                         f"sliding_window={hf.get('sliding_window')})")
    return window, types


def config_from_hf(hf: Mapping) -> ModelConfig:
    """Our ModelConfig from a Hugging Face config.json dict (model_type 'qwen2', 'llama', 'qwen3' or 'mistral').

    Reads both the transformers 4.x layout (top-level rope_theta, rope_scaling) and the 5.x one
    (rope_parameters). Raises ValueError for any setting our model does not implement.
    """
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise ValueError(f"model_type {family!r} is not supported; supported: {', '.join(FAMILIES)}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported; our MLP is SwiGLU with silu")
    row = ROWS[family]
    if hf.get("mlp_bias") and not row.mlp_bias:
        raise ValueError(f"mlp_bias=true is not part of {family}")
    if hf.get("attention_bias") and row.attention_bias is None:
        raise ValueError(f"attention_bias=true is not part of {family}")
    if settings := random_settings(hf):  # transformers' own modules train with them (megatrain.models.checkpoint)
        raise ValueError(f"{', '.join(f'{k}={v:g}' for k, v in settings.items())}: the hand-written {family} has no "
                         "dropout")
    missing = [k for k in REQUIRED_KEYS if k not in hf]
    if missing:
        raise ValueError(f"config.json lacks {', '.join(missing)}")
    theta, scaling = _rope_from_hf(hf)
    defaults = ROWS[family].defaults
    window, types = _attention_layers(hf, family, hf["num_hidden_layers"])
    attention_bias = bool(hf.get("attention_bias", row.attention_bias))
    if row.attention_bias and not attention_bias:
        raise ValueError(f"{family} with attention_bias=false is not supported (every release has the biases)")
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or defaults.get("num_key_value_heads", hf["num_attention_heads"]),
        head_dim=hf.get("head_dim") or defaults.get("head_dim", 0),
        qkv_bias=row.qkv_bias or attention_bias,
        o_bias=attention_bias,
        mlp_bias=bool(hf.get("mlp_bias", False)),
        qk_norm=row.qk_norm,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", defaults.get("rms_norm_eps", 1e-6))),
        max_seq_len=hf.get("max_position_embeddings", defaults["max_position_embeddings"]),
        family=family,
        sliding_window=window,
        layer_types=types,
        **(_experts_from_hf(hf, family) if family in MOE_FAMILIES else {}),
    )


def _experts_from_hf(hf: Mapping, family: str) -> dict:
    """The ModelConfig fields of a mixture of experts; layouts we do not build are refused by name."""
    defaults = ROWS[family].defaults
    quant = hf.get("quantization_config") or {}
    if quant and quant.get("quant_method") != "mxfp4":
        raise ValueError(f"quantization_config {quant.get('quant_method')!r} is not supported; only GPT-OSS's mxfp4 "
                         "experts (dequantized on load) or unquantized weights")
    coef = float(hf.get("router_aux_loss_coef", 0.001))  # transformers' default for both families
    fields = dict(num_experts_per_tok=hf.get("num_experts_per_tok", defaults.get("num_experts_per_tok", 0)),
                  router_aux_loss_coef=coef if hf.get("output_router_logits") else 0.0)
    if family == "gpt_oss":
        return dict(fields, num_experts=hf.get("num_local_experts", 128), moe_intermediate_size=hf["intermediate_size"],
                    norm_topk_prob=True, moe_bias=True, attention_sinks=True,
                    swiglu_limit=float(hf.get("swiglu_limit", defaults["swiglu_limit"])),
                    swiglu_alpha=float(hf.get("swiglu_alpha", defaults["swiglu_alpha"])))
    if quant:
        raise ValueError(f"{family} checkpoints with a quantization_config are not supported")
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
        raise ValueError(f"dense MLP layers among the experts (mlp_only_layers={hf.get('mlp_only_layers')}, "
                         f"decoder_sparse_step={hf.get('decoder_sparse_step')}) are not supported; every layer must "
                         "be a mixture of experts")
    experts = hf.get("num_experts", hf.get("num_local_experts", 128))
    if not experts:
        raise ValueError("qwen3_moe with num_experts=0 is a dense model: load it as model_type qwen3")
    return dict(fields, num_experts=experts, moe_intermediate_size=hf.get("moe_intermediate_size", 768),
                norm_topk_prob=bool(hf.get("norm_topk_prob", defaults["norm_topk_prob"])))


def _rope_to_hf(cfg: ModelConfig) -> dict:
    """rope_parameters (5.x) of a shape; without rope_theta it is also 4.x's rope_scaling."""
    s = cfg.rope_scaling
    if s is None:
        return {"rope_type": "default"}
    rope = {"rope_type": s.rope_type, "factor": s.factor}
    if s.rope_type == "llama3":
        rope.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor)
    if s.rope_type == "yarn":
        rope.update(beta_fast=s.beta_fast, beta_slow=s.beta_slow, truncate=s.truncate)
        rope.update({k: getattr(s, k) for k in ("attention_factor", "mscale", "mscale_all_dim")
                     if getattr(s, k) is not None})
    if s.rope_type in ("llama3", "yarn"):
        rope["original_max_position_embeddings"] = s.original_max_positions
    return rope


def config_to_hf(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """A config.json dict that transformers (4.x and 5.x) loads into the same architecture (cfg.family).

    Args:
        cfg: our model shape.
        dtype: the dtype the weights are stored in (config's torch_dtype / dtype field).
    """
    rope = _rope_to_hf(cfg)
    hf = {
        "architectures": [ROWS[cfg.family].architecture],
        "model_type": cfg.family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.rms_norm_eps,
        # 4.x reads the top-level rope_theta and rope_scaling, 5.x rope_parameters; both say the same.
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {**rope, "rope_theta": cfg.rope_theta},
        "rope_scaling": rope if cfg.rope_scaling else None,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        # 4.x reads torch_dtype, 5.x dtype.
        "torch_dtype": _dtype_name(dtype),
        "dtype": _dtype_name(dtype),
    }
    window = cfg.sliding_window or None
    row = ROWS[cfg.family]
    if row.windows == SUFFIX:
        # 5.x reads layer_types; 4.x slides the layers from max_window_layers on (a suffix, as every release has)
        types = [cfg.layer_type(n) for n in range(cfg.num_layers)]
        first = types.index(SLIDING) if SLIDING in types else cfg.num_layers
        hf.update(use_sliding_window=window is not None, sliding_window=window, max_window_layers=first,
                  layer_types=types)
    if row.windows == ALL:
        hf["sliding_window"] = window
    if row.attention_bias is not None:
        hf["attention_bias"] = cfg.o_bias
    if cfg.is_moe:
        hf.update(num_experts_per_tok=cfg.num_experts_per_tok, output_router_logits=cfg.router_aux_loss_coef > 0,
                  router_aux_loss_coef=cfg.router_aux_loss_coef or 0.001)
    if cfg.family == "qwen3_moe":
        hf.update(num_experts=cfg.num_experts, moe_intermediate_size=cfg.moe_intermediate_size,
                  norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[],
                  use_sliding_window=False, sliding_window=None)
    if cfg.family == "gpt_oss":
        hf.update(num_local_experts=cfg.num_experts, swiglu_limit=cfg.swiglu_limit, swiglu_alpha=cfg.swiglu_alpha,
                  sliding_window=cfg.sliding_window or None,
                  layer_types=[cfg.layer_type(n) for n in range(cfg.num_layers)])
    if row.mlp_bias:
        hf["mlp_bias"] = cfg.mlp_bias
    if cfg.family == "llama":
        hf["pretraining_tp"] = 1
    return hf


def _expected_shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    """Our parameter names (in module order) and shapes: the config's, which are the modules' (test_models holds
    them to a model built on the meta device; building one here imported torch._dynamo, ~1.3 s of every export)."""
    return {name: torch.Size(shape) for name, shape in cfg.param_shapes().items()}


def _check_names(names, expected, what: str) -> None:
    missing, unexpected = sorted(set(expected) - set(names)), sorted(set(names) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{what} does not match: missing {missing}, unexpected {unexpected}")


@torch.no_grad()
def save_hf_checkpoint(model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor], cfg: ModelConfig,
                       out_dir: str | Path, max_shard_bytes: int = 5 * 2**30,
                       dtype: torch.dtype | None = None) -> list[Path]:
    """Write a Hugging Face checkpoint: config.json and safetensors shards (plus an index if several).

    Only one shard is copied at a time (to CPU, dtype and contiguity), so saving from a model or
    from host tiles needs at most one shard of extra memory.

    Args:
        model_or_state_dict: our Transformer, or a mapping of our parameter names to tensors.
        cfg: the model's shape; names and shapes are checked against it.
        out_dir: directory to create or overwrite files in.
        max_shard_bytes: largest shard file in bytes (a single larger tensor gets a shard of its own).
        dtype: dtype to store; None keeps each tensor's dtype.

    Returns:
        paths of the weight files written.
    """
    if isinstance(model_or_state_dict, torch.nn.Module):
        state = model_or_state_dict.state_dict()
    else:  # read one tensor at a time: a mapping may assemble each on access (DeepSpeed's gathered weights)
        state = model_or_state_dict
    expected = _expected_shapes(cfg)
    _check_names(state.keys(), expected, "state dict vs model config")
    sizes = {}
    for name, shape in expected.items():
        tensor = state[name]
        if tensor.shape != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, the config implies {tuple(shape)}")
        sizes[name] = tensor.numel() * (dtype or tensor.dtype).itemsize
        del tensor
    shards = plan_shards(sizes, max_shard_bytes)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stored = dtype or state["embed_tokens.weight"].dtype
    (out_dir / "config.json").write_text(json.dumps(config_to_hf(cfg, stored), indent=2) + "\n")

    files = shard_names(len(shards))
    weight_map = {}
    for file, names in zip(files, shards, strict=True):
        tensors = {key: t.detach().to("cpu", dtype or t.dtype).contiguous() for n in names
                   for key, t in to_hf_tensors(cfg, n, state[n])}
        save_shard(tensors, out_dir / file)
        weight_map.update(dict.fromkeys(tensors, file))
        del tensors
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    # A previous save's single file or index would point loaders at stale weights.
    (out_dir / (SINGLE_FILE if len(files) > 1 else INDEX_FILE)).unlink(missing_ok=True)
    return [out_dir / f for f in files]


def _interleaved(gate_up: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's gate/up rows interleaved (gate at even indices of dim 1) from ours stacked (gate half first)."""
    gate, up = gate_up.chunk(2, dim=1)
    return torch.stack([gate, up], dim=2).flatten(1, 2)


def _stacked(gate_up: torch.Tensor) -> torch.Tensor:
    """Ours stacked (gate half first) from GPT-OSS's interleaved rows (dim 1)."""
    return torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1)


def to_hf_tensors(cfg: ModelConfig, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint tensors (HF key, tensor) that hold our parameter `name` in cfg.family's published layout."""
    key = hf_name(name)
    if not cfg.is_moe or ".mlp." not in key:
        return [(key, tensor)]
    layer, leaf = key.split(".mlp.")
    if cfg.family == "qwen3_moe":
        if leaf == "router.weight":
            return [(f"{layer}.mlp.gate.weight", tensor)]
        if leaf == "experts.gate_up_proj":
            return [(f"{layer}.mlp.experts.{e}.{proj}.weight", part) for e in range(cfg.num_experts)
                    for proj, part in zip(("gate_proj", "up_proj"), tensor[e].chunk(2), strict=True)]
        assert leaf == "experts.down_proj", leaf
        return [(f"{layer}.mlp.experts.{e}.down_proj.weight", tensor[e]) for e in range(cfg.num_experts)]
    if leaf.startswith("experts.gate_up_proj"):
        tensor = _interleaved(tensor)
    if leaf in ("experts.gate_up_proj", "experts.down_proj"):
        tensor = tensor.transpose(1, 2)  # theirs is [E, in, out]
    return [(key, tensor)]


def _from_checkpoint(cfg: ModelConfig, name: str, read: Tensors) -> torch.Tensor:
    """Our parameter `name` read from a checkpoint in any layout its family is published in."""
    key = hf_name(name)
    if not cfg.is_moe or ".mlp." not in key or (cfg.family == "qwen3_moe" and key in read):
        return read(key)  # qwen3_moe: 5.x's fused experts are ours
    layer, leaf = key.split(".mlp.")
    if cfg.family == "qwen3_moe":
        if leaf == "router.weight":
            return read(f"{layer}.mlp.gate.weight")
        projections = ("gate_proj", "up_proj") if leaf == "experts.gate_up_proj" else ("down_proj",)
        return torch.stack([torch.cat([read(f"{layer}.mlp.experts.{e}.{proj}.weight") for proj in projections])
                            for e in range(cfg.num_experts)])
    if leaf in ("experts.gate_up_proj", "experts.down_proj"):
        if key in read:
            tensor = read(key)
        else:  # the published MXFP4 blocks
            from megatrain.models.handwritten.mxfp4 import dequantize

            tensor = dequantize(read(key + "_blocks"), read(key + "_scales"))
        tensor = tensor.transpose(1, 2)
    else:
        tensor = read(key)
    if leaf.startswith("experts.gate_up_proj"):
        tensor = _stacked(tensor)
    return tensor.contiguous()


def check_weights(cfg: ModelConfig, path: Path, stored: Stored) -> None:
    """Every weight of cfg found in the checkpoint's headers (`stored`, of folder `path`), of the shape the config
    implies and a floating-point dtype, and no tensor it does not read, before a tensor is read; ValueError naming the
    first that is not."""
    for _ in _read_weights(cfg, Tensors(path, stored, meta=True)):
        pass


def read_weights(cfg: ModelConfig, path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(our name, tensor) of the checkpoint in folder `path` in the model's order, read one parameter at a time from
    its safetensors files and checked as check_weights checks them."""
    with contextlib.ExitStack() as stack:
        yield from _read_weights(cfg, Tensors(path, stored_tensors(path), stack))


def _read_weights(cfg: ModelConfig, read: Tensors) -> Iterator[tuple[str, torch.Tensor]]:
    """(our name, tensor) of every parameter of cfg from `read`, in the model's order, each of the shape the config
    implies and floating point; then any tensor left unread that transformers does not leave out either is refused by
    name. A stored buffer such as rotary_emb.inv_freq and a tied model's stored head are left out, as transformers
    does."""
    for name, shape in _expected_shapes(cfg).items():
        tensor = _from_checkpoint(cfg, name, read)
        key = hf_name(name)
        where = f"{read.stored[key].file}: " if key in read.stored else ""  # a tensor of its own in the file
        if tensor.shape != shape:
            raise ValueError(f"{where}{key} has shape {tuple(tensor.shape)}, the config implies {tuple(shape)}")
        if not tensor.dtype.is_floating_point:
            raise ValueError(f"{where}{key} is stored as {_dtype_name(tensor.dtype)}: weights are floating point")
        yield name, tensor
    ignored = {k for k in read.stored if k.endswith("rotary_emb.inv_freq")}
    ignored |= {"lm_head.weight"} if cfg.tie_embeddings else set()
    if unexpected := sorted(set(read.stored) - read.read_keys - ignored):
        raise ValueError(f"{read.stored[unexpected[0]].file} holds tensors this model does not have: {unexpected[:8]}"
                         f"{' ...' if len(unexpected) > 8 else ''}")
